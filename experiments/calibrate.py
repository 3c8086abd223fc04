"""Calibrate the simulator's cost model on this machine: run a sweep of synthetic workloads on the real engine,
record every step's features and measured time, fit cbjax.sim.CalibratedCost, write the JSON profile.

  python -m experiments.calibrate --model llama-tiny [--output configs/profiles/llama-tiny-cpu.json]

A step's time is what cbjax.bench.online moves a virtual clock by for the real engine (the wall time of the
engine's step call up to the fetch of its results), so the simulator advances its clock the same way. The sweep:
  decode  N sequences (1 .. max_num_seqs) with contexts of C tokens (16 .. 512), 48 decode steps each
  prefill prompts long enough to fill every token bucket (chunked under the budget), few output tokens
  batch   full batches of random-length requests, all at once (many sequences decoding, prompts joining)
  mixed   Poisson arrivals of random-length requests (prefill chunks and decodes in the same step)
  swap    40 of those requests into a small KV pool with preemption by swap (the cost per byte copied)
The engine options are compare_cpu.py's (override with flags); the profile records them with the model, the jax
version, the machine, its load average and the date. Keep the machine otherwise idle while this runs, and
validate (experiments/sim_fidelity.py) in the same sitting. About 2-4 minutes on 2 CPU cores.
"""

import datetime
import json
import os
import platform

from absl import app, flags

flags.DEFINE_string("model", "llama-tiny", "named model config or checkpoint (as LLMEngine's model=)")
flags.DEFINE_string("output", None, "profile path (default: configs/profiles/<model>-cpu.json)")
flags.DEFINE_integer("max_num_seqs", 32, "slots per step")
flags.DEFINE_integer("max_num_batched_tokens", 256, "token budget per step")
flags.DEFINE_integer("page_size", 16, "tokens per KV page")
flags.DEFINE_integer("num_pages", 1024, "KV pages")
flags.DEFINE_integer("max_model_len", 1024, "prompt + output tokens")
flags.DEFINE_string("dtype", "float32", "float32 | bfloat16")
flags.DEFINE_bool("async_scheduling", True, "schedule step n+1 while step n runs")
flags.DEFINE_integer("seed", 1234, "workload seed (keep it apart from the fidelity workloads' seeds)")
flags.DEFINE_string("steps_output", None, "also write every measured step (sweep, features, seconds) as JSONL here")
flags.DEFINE_float("scale", 1.0, "multiplies the number of requests of each sweep (0.5: a quicker, rougher fit)")
FLAGS = flags.FLAGS

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def engine_options() -> dict:
    return dict(
        max_num_seqs=FLAGS.max_num_seqs,
        max_num_batched_tokens=FLAGS.max_num_batched_tokens,
        page_size=FLAGS.page_size,
        num_pages=FLAGS.num_pages,
        max_model_len=FLAGS.max_model_len,
        dtype=FLAGS.dtype,
        async_scheduling=FLAGS.async_scheduling,
        warmup=True,
    )


def sweep_workloads(vocab_size: int, max_num_seqs: int, max_model_len: int) -> dict[str, list]:
    """name -> workload (cbjax.bench.workload requests)."""
    import numpy as np

    from cbjax.bench.requests import WorkloadRequest
    from cbjax.bench.workload import make_workload

    rng = np.random.default_rng(FLAGS.seed)
    k = FLAGS.scale
    out = {}
    decode = []
    for n in sorted({1, 2, 4, 8, 16, max_num_seqs}):
        for ctx in (16, 128, 512):
            for i in range(n):
                prompt = tuple(int(x) for x in rng.integers(3, vocab_size, ctx))
                decode.append(WorkloadRequest(f"d{n}-{ctx}-{i}", 0.0, prompt, 48))
    # Offline groups run one after another (each group's arrival waits for the previous to drain).
    out["decode"] = decode
    out["prefill"] = make_workload(
        dict(kind="synthetic", num_requests=max(4, int(24 * k)), seed=FLAGS.seed, arrival="offline",
             prompt_len=dict(dist="uniform", low=64, high=max_model_len - 8), output_len=2, vocab_size=vocab_size)
    )  # fmt: skip
    out["batch"] = make_workload(
        dict(kind="synthetic", num_requests=max(32, int(128 * k)), seed=FLAGS.seed + 2, arrival="offline",
             prompt_len=dict(dist="uniform", low=8, high=400), output_len=dict(dist="uniform", low=16, high=300),
             vocab_size=vocab_size)
    )  # fmt: skip
    out["mixed"] = make_workload(
        dict(kind="synthetic", num_requests=max(20, int(200 * k)), seed=FLAGS.seed + 1, arrival="poisson",
             request_rate=30.0, prompt_len=dict(dist="uniform", low=8, high=600),
             output_len=dict(dist="uniform", low=4, high=200), vocab_size=vocab_size)
    )  # fmt: skip
    return out


def machine() -> dict:
    import jax

    d = jax.devices()[0]
    return dict(
        platform=platform.platform(),
        processor=platform.processor() or platform.machine(),
        cpu_count=os.cpu_count(),
        device=f"{d.platform}:{getattr(d, 'device_kind', '?')}",
        load_average_1_5_15=list(os.getloadavg()),
    )


def main(argv):
    del argv
    import jax

    from cbjax.core.clock import VirtualClock
    from cbjax.engine import LLMEngine
    from cbjax.sim import CalibratedCost, save_profile
    from experiments.measured_steps import measure

    opts = engine_options()
    start = datetime.datetime.now().astimezone()
    load_before = list(os.getloadavg())
    engine = LLMEngine(FLAGS.model, clock=VirtualClock(), **opts)
    engine.wait_until_warm()
    feats, times, counts = [], [], {}
    cfg = engine.config
    for name, wl in sweep_workloads(engine.model_config.vocab_size, cfg.max_num_seqs, cfg.max_model_len).items():
        f, t, _ = measure(engine, wl)
        feats += f
        times += t
        counts[name] = len(f)
        print(f"{name}: {len(f)} steps, {sum(t):.2f} s measured")
    # Swaps: a pool small enough that the mix preempts (its own engine: a different KV shape).
    swap_opts = dict(opts, num_pages=48, watermark_fraction=0.0, preemption_mode="swap", swap_space_gib=0.25)
    swapper = LLMEngine(FLAGS.model, clock=VirtualClock(), **swap_opts)
    swapper.wait_until_warm()
    # A few requests: a small pool thrashes for many steps, which would outweigh the other sweeps in the fit.
    wl = sweep_workloads(engine.model_config.vocab_size, cfg.max_num_seqs, cfg.max_model_len)["mixed"][:40]
    f, t, _ = measure(swapper, wl)
    feats += f
    times += t
    counts["swap"] = len(f)
    print(f"swap: {len(f)} steps ({sum(x.swap_bytes > 0 for x in f)} with swaps), {sum(t):.2f} s measured")
    model = CalibratedCost.fit(feats, times)
    i = 0
    for name, n in counts.items():  # how well one model fits each sweep's total time
        pred = sum(map(model.step_time, feats[i : i + n]))
        print(f"  {name}: predicted / measured total {pred / sum(times[i : i + n]) - 1:+.1%}")
        i += n
    if FLAGS.steps_output:
        with open(FLAGS.steps_output, "w") as f:
            i = 0
            for name, n in counts.items():
                for ft, t in zip(feats[i : i + n], times[i : i + n]):
                    f.write(json.dumps({"sweep": name, "seconds": t, **ft.as_dict()}) + "\n")
                i += n
    meta = dict(
        model=FLAGS.model,
        engine_options=opts,
        swap_engine_options=swap_opts,
        jax_version=jax.__version__,
        machine=machine(),
        load_average_before=load_before,
        date=start.isoformat(timespec="seconds"),
        steps_per_sweep=counts,
        command="python -m experiments.calibrate " + " ".join(f"--{k}={v}" for k, v in sorted(flag_values().items())),
    )
    output = FLAGS.output or os.path.join(_ROOT, "configs", "profiles", f"{FLAGS.model}-cpu.json")
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    save_profile(model, output, meta)
    print(json.dumps(model.to_dict()["coefficients_s"]))
    print(f"fit: {json.dumps(model.fit_stats['mean_abs_rel_error'])} mean |relative error| per step over "
          f"{len(times)} steps; total time error {model.fit_stats['total_rel_error']:+.2%}")  # fmt: skip
    print(f"profile: {output}")


def flag_values() -> dict:
    names = ("model", "max_num_seqs", "max_num_batched_tokens", "page_size", "num_pages", "max_model_len", "dtype",
             "async_scheduling", "seed", "scale")  # fmt: skip
    return {n: FLAGS[n].value for n in names}


if __name__ == "__main__":
    app.run(main)
