"""Calibrate the simulator's cost model on this machine: run a sweep of synthetic workloads on the real engine,
record every step's features and measured time, fit cbjax.sim.CalibratedCost, write the JSON profile.

  python -m experiments.calibrate --model llama-tiny [--output configs/profiles/llama-tiny-cpu.json]

The sweep and the fit are cbjax/sim_calibration.py's (the same as the engine option sim_profile="auto", which
calibrates and caches a profile per machine and setup by itself). The engine options are the zoo's shape (32 slots,
a 256-token budget, 1024 pages of 16 tokens, 1024 tokens per sequence, float32; override with flags); the profile
records them with the model, the jax version, the machine, its load average, the date and its origin (CPU, jax,
the fingerprint of the step's code: cbjax/sim/provenance.py), so a simulation that loads it on another machine or
tree says so. Keep the machine otherwise idle while this runs, and validate (experiments/fidelity_study.py) in the
same sitting. 40-60 s on 2 quiet CPU cores with jax's compilation cache warm, 2-2.5 minutes cold or with other
jobs on the cores (docs/sim.md, "Profiles").
"""

import datetime
import json
import os
import platform
import time

from absl import app, flags

from cbjax.bench.results import cpu_model

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


def machine() -> dict:
    import jax

    d = jax.devices()[0]
    return dict(
        platform=platform.platform(),
        processor=cpu_model(),
        cpu_count=os.cpu_count(),
        device=f"{d.platform}:{getattr(d, 'device_kind', '?')}",
        load_average_1_5_15=list(os.getloadavg()),
    )


def main(argv):
    del argv
    import jax

    from cbjax.sim import save_profile
    from cbjax.sim.provenance import origin
    from cbjax.sim_calibration import calibrate
    from experiments.measured_steps import write_steps

    opts = engine_options()
    start = datetime.datetime.now().astimezone()
    load_before = list(os.getloadavg())
    here, t0 = origin(), time.perf_counter()  # (the code as it was when the steps were measured)
    cal = calibrate(FLAGS.model, opts, seed=FLAGS.seed, scale=FLAGS.scale, log=print)
    model, times, counts = cal.model, cal.times, cal.steps_per_sweep
    if FLAGS.steps_output:
        write_steps(FLAGS.steps_output, cal.groups())
    meta = dict(
        model=FLAGS.model,
        engine_options=opts,
        swap_engine_options=cal.swap_engine_options,
        jax_version=jax.__version__,
        machine=machine(),
        origin=here,
        calibration_s=time.perf_counter() - t0,
        load_average_before=load_before,
        load_average_after=list(os.getloadavg()),
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
