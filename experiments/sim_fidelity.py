"""How close the simulator comes to the real engine: the same workloads, on the real engine (llama-tiny, virtual
clock advanced by each step's measured wall time, as configs/policy_zoo.py runs) and on the simulator with the
calibrated profile; prints each metric's relative error (sim / real - 1) and writes them as JSON. "step times" is
the cost model's error on the real run's own steps (sum predicted / sum measured - 1), before any feedback
through the schedule.

  python -m experiments.calibrate --model llama-tiny          # first, in the same sitting
  python -m experiments.sim_fidelity --profile configs/profiles/llama-tiny-cpu.json [--cases mixed-fcfs,...]
  python -m experiments.sim_fidelity --recalibrate [--calibration_scale 0.5]   # a fresh fit before each case

On a shared machine the step times follow the other jobs' load, which moves within minutes. With --recalibrate
each case gets its own profile, fitted (on the calibration sweep, never on the case's workload) right before the
case's real run, so both see about the same machine; the profiles are written next to the output.

The workloads are not the calibration's (that one used uniform random lengths and fixed decode groups, seeds
1234-1235): the chat/RAG/code mix (Poisson), lognormal synthetic lengths, shared system prompts with the prefix
cache, and the mix offline into a small KV pool (preemption by recompute and by swap). Engine options are
compare_cpu.py's (32 slots, 256-token budget, 1024 pages of 16 tokens, max_model_len 1024, float32).
"""

import json
import math
import os

from absl import app, flags

flags.DEFINE_string("profile", None, "cost-model profile (experiments/calibrate.py); not with --recalibrate")
flags.DEFINE_bool("recalibrate", False, "fit a fresh profile right before each case (the calibration sweep)")
flags.DEFINE_float("calibration_scale", 0.5, "--recalibrate: the calibration sweep's scale (calibrate's --scale)")
flags.DEFINE_integer("calibration_seed", 1234, "--recalibrate: the calibration sweep's seed (calibrate's --seed)")
flags.DEFINE_string("model", "llama-tiny", "the model the profile was calibrated for")
flags.DEFINE_list("cases", None, "cases to run (default: all of CASES)")
flags.DEFINE_float("scale", 1.0, "multiplies each case's number of requests")
flags.DEFINE_string("output", "results/sim_fidelity.json", "where the errors go (JSON)")
FLAGS = flags.FLAGS

ENGINE = dict(max_num_seqs=32, max_num_batched_tokens=256, page_size=16, num_pages=1024, max_model_len=1024,
              dtype="float32", warmup=True)  # fmt: skip
MIX = dict(kind="mixed", scale=0.125, arrival="poisson", request_rate=36.0, seed=0, num_requests=300)
# name -> (workload fields, engine options over ENGINE)
CASES = {
    "mixed-fcfs": (MIX, dict(policy="fcfs")),
    "mixed-static": (MIX, dict(policy="static", static_batch_timeout_s=0.5)),
    "mixed-sarathi": (MIX, dict(policy="sarathi")),
    "mixed-priority": (dict(MIX, tenant_priority=dict(chat=0, code=1, rag=2)), dict(policy="priority")),
    "mixed-mlfq": (MIX, dict(policy="mlfq")),
    "synthetic-fcfs": (
        dict(
            kind="synthetic",
            arrival="poisson",
            request_rate=30.0,
            seed=7,
            num_requests=300,
            prompt_len=dict(dist="lognormal", median=120, sigma=0.8, max=700),
            output_len=dict(dist="lognormal", median=40, sigma=0.8, max=300),
        ),
        dict(policy="fcfs"),
    ),
    "shared_prefix-fcfs": (
        dict(
            kind="shared_prefix",
            arrival="poisson",
            request_rate=40.0,
            seed=3,
            num_requests=300,
            num_prefixes=4,
            prefix_len=256,
            prompt_len=64,
            output_len=32,
        ),
        dict(policy="fcfs", enable_prefix_caching=True),
    ),
    "preempt-recompute": (
        dict(MIX, arrival="offline", num_requests=160, max_model_len=512),
        dict(policy="fcfs", num_pages=64, watermark_fraction=0.0, max_model_len=512),
    ),
    "preempt-swap": (
        dict(MIX, arrival="offline", num_requests=160, max_model_len=512),
        dict(
            policy="fcfs",
            num_pages=64,
            watermark_fraction=0.0,
            max_model_len=512,
            preemption_mode="swap",
            swap_space_gib=0.25,
        ),
    ),
}
METRICS = ("output_throughput", "ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50", "e2e_ms_p50")


def run_case(model: str, profile: str, workload_fields: dict, options: dict, scale: float) -> dict:
    """{"real": summary, "sim": summary, "error": {metric: sim / real - 1}} of one case."""
    from cbjax.bench.metrics import summarize
    from cbjax.bench.online import run_online
    from cbjax.bench.workload import make_workload
    from cbjax.core.clock import VirtualClock
    from cbjax.engine import LLMEngine
    from cbjax.model.registry import model_config_of
    from cbjax.sim import load_profile
    from experiments.measured_steps import measure

    fields = dict(workload_fields, vocab_size=model_config_of(model).vocab_size)
    fields["num_requests"] = max(10, int(fields["num_requests"] * scale))
    fields.setdefault("max_model_len", ENGINE["max_model_len"])
    workload = make_workload(fields)
    out = {}
    for key, runner in (("real", "model"), ("sim", "sim")):
        opts = dict(ENGINE, **options, runner=runner)
        if runner == "sim":
            opts.update(sim_profile=profile, warmup=False)
        engine = LLMEngine(model, clock=VirtualClock(), **opts)
        engine.wait_until_warm()
        if runner == "model":
            # The cost model on the real run's own steps: how far its step times are off before any feedback
            # through the schedule.
            feats, times, res = measure(engine, workload)
            predicted = sum(map(load_profile(profile).step_time, feats))
            out["step_time_error"] = predicted / sum(times) - 1
        else:
            res = run_online(engine, workload)
        s = summarize(res.requests, res.steps)
        out[key] = {k: s[k] for k in (*METRICS, "num_completed", "request_preemptions")} | {"wall_s": res.wall_s}
        del engine
    out["error"] = {k: out["sim"][k] / out["real"][k] - 1 for k in METRICS}
    return out


def table(results: dict) -> str:
    head = "| case | " + " | ".join(METRICS) + " | step times | real / sim wall s |"
    lines = [head, "|" + "---|" * (len(METRICS) + 3)]
    for name, r in results.items():
        errs = " | ".join("-" if math.isnan(r["error"][k]) else f"{r['error'][k]:+.1%}" for k in METRICS)
        walls = f"{r['real']['wall_s']:.1f} / {r['sim']['wall_s']:.2f}"
        lines.append(f"| {name} | {errs} | {r['step_time_error']:+.1%} | {walls} |")
    return "\n".join(lines)


def fresh_profile(case: str) -> str:
    """Fit a profile on the calibration sweep now (not on the case's workload); returns its path."""
    import datetime

    from cbjax.sim import save_profile
    from experiments.calibration_sweep import calibrate

    start = datetime.datetime.now().astimezone()
    load = list(os.getloadavg())
    opts = dict(ENGINE)
    cal = calibrate(FLAGS.model, opts, seed=FLAGS.calibration_seed, scale=FLAGS.calibration_scale, log=lambda s: None)
    path = os.path.join(os.path.dirname(os.path.abspath(FLAGS.output)), "sim_fidelity_profiles", f"{case}.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    meta = dict(model=FLAGS.model, engine_options=opts, date=start.isoformat(timespec="seconds"),
                load_average_before=load, steps_per_sweep=cal.steps_per_sweep, fitted_for_case=case,
                calibration_scale=FLAGS.calibration_scale, calibration_seed=FLAGS.calibration_seed)  # fmt: skip
    save_profile(cal.model, path, meta)
    print(f"{case}: profile fitted on {len(cal.times)} calibration steps (load {load[0]:.1f})", flush=True)
    return path


def main(argv):
    del argv
    names = FLAGS.cases or list(CASES)
    unknown = sorted(set(names) - set(CASES))
    if unknown:
        raise app.UsageError(f"unknown cases {unknown}; known: {list(CASES)}")
    if FLAGS.recalibrate == (FLAGS.profile is not None):
        raise app.UsageError("give exactly one of --profile and --recalibrate")
    load = list(os.getloadavg())
    results = {}
    for name in names:
        profile = FLAGS.profile
        if FLAGS.recalibrate:
            profile = fresh_profile(name)
        results[name] = run_case(FLAGS.model, profile, *CASES[name], FLAGS.scale)
        results[name].update(profile=profile, load_average=list(os.getloadavg()))
        print(name, json.dumps(results[name]["error"]), "step times", results[name]["step_time_error"], flush=True)
    print(table(results))
    os.makedirs(os.path.dirname(os.path.abspath(FLAGS.output)), exist_ok=True)
    with open(FLAGS.output, "w") as f:
        json.dump(dict(profile=FLAGS.profile, recalibrate=FLAGS.recalibrate, calibration_scale=FLAGS.calibration_scale,
                       load_average_before=load, load_average_after=list(os.getloadavg()),
                       cases=results), f, indent=1)  # fmt: skip
    print(f"written: {FLAGS.output}")


if __name__ == "__main__":
    app.run(main)
