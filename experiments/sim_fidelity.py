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
case's real run, so both see about the same machine; the profiles are written next to the output. What else it
prints, to tell the simulator's error from the machine's:
- the real engine against itself: each case runs `--real_repeats` times (a fresh engine each time); the spread
  of those runs is the floor under any simulator's error, and errors are also given against their median;
- the profile scaled by the machine's speed around the first real run: a fixed probe workload (not a case's) runs
  before and after it, and its measured / predicted time scales the profile;
- with --recalibrate and several cases, one profile fitted on every case's calibration sweep (the sitting's
  typical speed) against the median real run.

The workloads are not the calibration's (that one used uniform random lengths and fixed decode groups, seeds
1234-1235): the chat/RAG/code mix (Poisson), lognormal synthetic lengths, shared system prompts with the prefix
cache, and the mix offline into a small KV pool (preemption by recompute and by swap). Engine options are
compare_cpu.py's (32 slots, 256-token budget, 1024 pages of 16 tokens, max_model_len 1024, float32).
"""

import json
import math
import os
import statistics

from absl import app, flags

flags.DEFINE_string("profile", None, "cost-model profile (experiments/calibrate.py); not with --recalibrate")
flags.DEFINE_bool("recalibrate", False, "fit a fresh profile right before each case (the calibration sweep)")
flags.DEFINE_float("calibration_scale", 0.5, "--recalibrate: the calibration sweep's scale (calibrate's --scale)")
flags.DEFINE_integer("calibration_seed", 1234, "--recalibrate: the calibration sweep's seed (calibrate's --seed)")
flags.DEFINE_string("model", "llama-tiny", "the model the profile was calibrated for")
flags.DEFINE_integer("real_repeats", 2, "real runs per case (the later ones measure the real engine's own spread)")
flags.DEFINE_list("cases", None, "cases to run (default: all of CASES)")
flags.DEFINE_float("scale", 1.0, "multiplies each case's number of requests")
flags.DEFINE_string("output", "results/sim_fidelity.json", "where the errors go (JSON)")
flags.DEFINE_string("steps_output", None, "a folder: write every measured step (calibration, real run) as JSONL there")
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


def probe_workload(vocab_size: int) -> list:
    """The machine-speed probe: a fixed small Poisson workload of random lengths (seed 99, apart from every other
    seed here), ~2-3 s on llama-tiny. Not a case's workload: its steps only say how fast the machine runs now."""
    from cbjax.bench.workload import make_workload

    return make_workload(
        dict(kind="synthetic", num_requests=24, seed=99, arrival="poisson", request_rate=30.0,
             prompt_len=dict(dist="uniform", low=8, high=600), output_len=dict(dist="uniform", low=4, high=100),
             vocab_size=vocab_size, max_model_len=ENGINE["max_model_len"])
    )  # fmt: skip


def machine_speed(probe_engine, probe, cost) -> float:
    """Measured / predicted seconds of the probe's steps now: > 1 when the machine runs slower than at calibration."""
    from experiments.measured_steps import measure

    feats, times, _ = measure(probe_engine, probe)
    return sum(times) / sum(map(cost.step_time, feats))


def case_workload(model: str, workload_fields: dict, scale: float) -> list:
    from cbjax.bench.workload import make_workload
    from cbjax.model.registry import model_config_of

    fields = dict(workload_fields, vocab_size=model_config_of(model).vocab_size)
    fields["num_requests"] = max(10, int(fields["num_requests"] * scale))
    fields.setdefault("max_model_len", ENGINE["max_model_len"])
    return make_workload(fields)


def summary(res) -> dict:
    from cbjax.bench.metrics import summarize

    s = summarize(res.requests, res.steps)
    return {k: s[k] for k in (*METRICS, "num_completed", "request_preemptions")} | {"wall_s": res.wall_s}


def simulate(model: str, workload: list, options: dict, cost) -> dict:
    """The case on the simulator with cost model `cost`: its summary."""
    from cbjax.bench.online import run_online
    from cbjax.core.clock import VirtualClock
    from cbjax.engine import LLMEngine

    engine = LLMEngine(model, clock=VirtualClock(), cost_model=cost, **dict(ENGINE, **options, runner="sim"))
    return summary(run_online(engine, workload))


def compare(out: dict, key: str, sim: dict, steps, cost) -> None:
    """Errors of simulated summary `sim` against the first real run (`error{key}`) and against the median of the
    real runs (`error{key}_vs_median`), and the cost model's error on the first real run's steps."""
    real, median = out["real"], out["real_median"]
    out[f"sim{key}"] = sim
    out[f"error{key}"] = {k: sim[k] / real[k] - 1 for k in METRICS}
    out[f"error{key}_vs_median"] = {k: sim[k] / median[k] - 1 for k in METRICS}
    feats, times = steps
    out[f"step_time_error{key}"] = sum(map(cost.step_time, feats)) / sum(times) - 1


def run_case(model: str, cost, workload: list, options: dict) -> tuple[dict, tuple]:
    """One case: the real engine `--real_repeats` times (each between two probes of the machine's speed), then the
    simulator with the profile as fitted ("sim") and scaled by the machine's speed around the first real run
    ("sim_speed_scaled"). "real_spread" is each later real run against the first. Returns the results and the
    first real run's steps (features, seconds)."""
    from cbjax.core.clock import VirtualClock
    from cbjax.engine import LLMEngine
    from cbjax.model.registry import model_config_of
    from experiments.measured_steps import measure

    probe = probe_workload(model_config_of(model).vocab_size)
    # The probe runs on its own engine with the calibration's options (no prefix cache to disturb the case's).
    prober = LLMEngine(model, clock=VirtualClock(), **ENGINE)
    prober.wait_until_warm()
    out, first_steps = {"real_runs": [], "speed": []}, None
    for _ in range(FLAGS.real_repeats):
        before = machine_speed(prober, probe, cost)
        engine = LLMEngine(model, clock=VirtualClock(), **dict(ENGINE, **options))
        engine.wait_until_warm()
        feats, times, res = measure(engine, workload)
        del engine
        after = machine_speed(prober, probe, cost)
        out["speed"].append([before, after])
        out["real_runs"].append(summary(res))
        first_steps = first_steps or (feats, times)
    del prober
    out["real"] = out["real_runs"][0]
    # The median real run, metric by metric (with >= 3 runs, one slow or fast sitting does not set it).
    out["real_median"] = {k: statistics.median(r[k] for r in out["real_runs"]) for k in METRICS}
    out["real_spread"] = [{k: r[k] / out["real"][k] - 1 for k in METRICS} for r in out["real_runs"][1:]]
    scaled = cost.scaled(sum(out["speed"][0]) / 2)
    for key, c in (("", cost), ("_speed_scaled", scaled)):
        compare(out, key, simulate(model, workload, options, c), first_steps, c)
    return out, first_steps


def table(results: dict, errors: str, step_key: str | None, title: str) -> str:
    """A markdown table of each case's errors `results[case][errors]` (a list: its first), with step times."""
    head = "| case | " + " | ".join(METRICS) + (" | step times |" if step_key else " |")
    lines = [title, "", head, "|" + "---|" * (len(METRICS) + 1 + bool(step_key))]
    for name, r in results.items():
        e = r[errors]
        if isinstance(e, list):
            if not e:
                continue
            e = e[0]
        errs = " | ".join("-" if math.isnan(e[k]) else f"{e[k]:+.1%}" for k in METRICS)
        lines.append(f"| {name} | {errs} |" + (f" {r[step_key]:+.1%} |" if step_key else ""))
    return "\n".join(lines)


def fresh_profile(case: str):
    """Fit a profile on the calibration sweep now (not on the case's workload); returns its path and the sweep."""
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
    if FLAGS.steps_output:
        from experiments.measured_steps import write_steps

        write_steps(os.path.join(FLAGS.steps_output, f"{case}_calibration.jsonl"), cal.groups())
    print(f"{case}: profile fitted on {len(cal.times)} calibration steps (load {load[0]:.1f})", flush=True)
    return path, cal


def main(argv):
    del argv
    from cbjax.sim import CalibratedCost, load_profile
    from experiments.measured_steps import write_steps

    names = FLAGS.cases or list(CASES)
    unknown = sorted(set(names) - set(CASES))
    if unknown:
        raise app.UsageError(f"unknown cases {unknown}; known: {list(CASES)}")
    if FLAGS.recalibrate == (FLAGS.profile is not None):
        raise app.UsageError("give exactly one of --profile and --recalibrate")
    if FLAGS.steps_output:
        os.makedirs(FLAGS.steps_output, exist_ok=True)
    load = list(os.getloadavg())
    results, calibration, real_steps = {}, ([], []), {}
    for name in names:
        profile = FLAGS.profile
        if FLAGS.recalibrate:
            profile, cal = fresh_profile(name)
            calibration[0].extend(cal.features)
            calibration[1].extend(cal.times)
        workload = case_workload(FLAGS.model, CASES[name][0], FLAGS.scale)
        results[name], real_steps[name] = run_case(FLAGS.model, load_profile(profile), workload, CASES[name][1])
        if FLAGS.steps_output:
            write_steps(os.path.join(FLAGS.steps_output, f"{name}_real.jsonl"), {"real": real_steps[name]})
        results[name].update(profile=profile, load_average=list(os.getloadavg()))
        r = results[name]
        print(name, json.dumps(r["error"]), "step times", r["step_time_error"], "speed", r["speed"], flush=True)
    if FLAGS.recalibrate and len(names) > 1:
        # Every case's calibration sweep in one fit: the machine's typical speed over the whole sitting, the
        # counterpart of the median real run.
        pooled = CalibratedCost.fit(*calibration)
        for name in names:
            workload = case_workload(FLAGS.model, CASES[name][0], FLAGS.scale)
            sim = simulate(FLAGS.model, workload, CASES[name][1], pooled)
            compare(results[name], "_pooled", sim, real_steps[name], pooled)
    print(table(results, "error", "step_time_error", "Simulator / real - 1, the profile as fitted:"))
    print(table(results, "error_speed_scaled", "step_time_error_speed_scaled",
                "The profile scaled by the machine's speed around the real run (the probe):"))  # fmt: skip
    print(table(results, "real_spread", None, "The real engine against itself (second real run / first - 1):"))
    print(table(results, "error_vs_median", None, "Simulator (as fitted) / the median of the real runs - 1:"))
    if "sim_pooled" in results[names[0]]:
        title = "Simulator, one profile fitted on every case's calibration / the median of the real runs - 1:"
        print(table(results, "error_pooled_vs_median", "step_time_error_pooled", title))
    os.makedirs(os.path.dirname(os.path.abspath(FLAGS.output)), exist_ok=True)
    with open(FLAGS.output, "w") as f:
        json.dump(dict(profile=FLAGS.profile, recalibrate=FLAGS.recalibrate, calibration_scale=FLAGS.calibration_scale,
                       real_repeats=FLAGS.real_repeats,
                       load_average_before=load, load_average_after=list(os.getloadavg()),
                       cases=results), f, indent=1)  # fmt: skip
    print(f"written: {FLAGS.output}")


if __name__ == "__main__":
    app.run(main)
