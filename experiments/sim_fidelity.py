"""How close the simulator comes to the real engine. By default this runs the fidelity study (issue 35, point 3;
experiments/fidelity_study.py): five policies on three held-out workloads (the chat/RAG/code mix offline, near
saturation and in overload), five interleaved real rounds each, and the three targets: step-level bias within
±5% on every workload, >= 90% of the simulated figures inside the real runs' 95% interval or within 10%, and
every pair of policies the real runs separate ordered alike (Kendall's tau 1). It reports each target as met or
missed by how much (docs/sim.md, "Fidelity against the real engine").

  python -m experiments.sim_fidelity [--profile auto|PROFILE.json] [--repeats 5] [--output STUDY.json]
  python -m experiments.sim_fidelity --report STUDY.json          # the tables and verdicts of a saved study

The older per-case protocol (one policy per workload, each metric against the median of a few real runs, 10%
per metric; its sittings are in docs/archive/sim-fidelity-history.md) is --mode=cases:

  python -m experiments.calibrate --model llama-tiny          # first, in the same sitting
  python -m experiments.sim_fidelity --mode=cases --profile configs/profiles/llama-tiny-cpu.json [--cases ...]
  python -m experiments.sim_fidelity --mode=cases --recalibrate [--calibration_scale 0.1]   # calibration rounds
  python -m experiments.sim_fidelity --report results/sim_fidelity.json     # the tables of a saved per-case run

On a shared machine the step times follow the other jobs' load, which moves within minutes. So each case's real
engine runs `--real_repeats` times (a fresh engine each time): the spread of those runs is the floor under any
simulator's error, and the errors are given against their median, metric by metric, beside the real runs' own
range. With --recalibrate, a calibration round (the sweep, never on a case's workload) runs right before each
real run and the case's profile is fitted on all its rounds, so calibration and real runs see the same minutes of
the machine; the profiles are written next to the output. With several cases, one more profile fitted on every
case's rounds (the sitting's typical speed) is compared with the median real runs too.

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

from cbjax.bench.results import cpu_model

flags.DEFINE_enum("mode", "study", ["study", "cases"], "study: the fidelity study (its three targets); cases: the "
                  "older per-case protocol")  # fmt: skip
flags.DEFINE_string("profile", None, "cost-model profile (experiments/calibrate.py), or auto (study: the default); "
                    "cases: not with --recalibrate")  # fmt: skip
flags.DEFINE_integer("repeats", 5, "study: real rounds per workload, every policy once per round")
flags.DEFINE_bool("recalibrate", False, "calibration rounds between the real runs, a profile per case")
flags.DEFINE_float("calibration_scale", 0.1, "--recalibrate: each round's sweep scale (calibrate's --scale)")
flags.DEFINE_integer("calibration_seed", 1234, "--recalibrate: the calibration sweep's seed (calibrate's --seed)")
flags.DEFINE_string("model", "llama-tiny", "the model the profile was calibrated for")
flags.DEFINE_integer(
    "real_repeats", 3, "cases: real runs per case (the real engine's own spread; the median is compared)"
)
flags.DEFINE_list("cases", None, "cases: the cases to run (default: all of CASES)")
flags.DEFINE_float("scale", 1.0, "multiplies the study's or each case's number of requests")
flags.DEFINE_string("output", None, "where the results go (JSON; default: the study's docs/data/"
                    "sim_fidelity_study_<date>.json, the cases' results/sim_fidelity.json)")  # fmt: skip
flags.DEFINE_bool("probe", True, "study: scale the profile by speed probes timed before each real run")
flags.DEFINE_string("report", None, "print the tables of a saved study or per-case run (its JSON) and exit")
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


def run_case(name: str, profile: str | None, workload: list, options: dict) -> tuple[dict, tuple, tuple]:
    """One case: the real engine `--real_repeats` times, a fresh engine each time; with `profile` None
    (--recalibrate), a calibration round right before each real run and the case's profile fitted on all its
    rounds, so the calibration brackets the real runs in time. Then the simulator with that profile. "real_spread"
    is each later real run against the first. Returns the results, the first real run's steps and the case's
    calibration steps (features, seconds)."""
    from cbjax.core.clock import VirtualClock
    from cbjax.engine import LLMEngine
    from cbjax.sim import CalibratedCost, load_profile
    from experiments.measured_steps import measure

    out, run_steps, rounds = {"real_runs": []}, [], ([], [])
    for _ in range(FLAGS.real_repeats):
        if profile is None:
            cal = calibration_round(name, len(out["real_runs"]))
            rounds[0].extend(cal.features)
            rounds[1].extend(cal.times)
        engine = LLMEngine(FLAGS.model, clock=VirtualClock(), **dict(ENGINE, **options))
        engine.wait_until_warm()
        feats, times, res = measure(engine, workload)
        del engine
        out["real_runs"].append(summary(res))
        run_steps.append((feats, times))
    cost = CalibratedCost.fit(*rounds) if profile is None else load_profile(profile)
    out["profile"] = profile or save_case_profile(name, cost)
    out["real"] = out["real_runs"][0]
    # The median real run, metric by metric (with >= 3 runs, one slow or fast sitting does not set it).
    out["real_median"] = {k: statistics.median(r[k] for r in out["real_runs"]) for k in METRICS}
    out["real_spread"] = [{k: r[k] / out["real"][k] - 1 for k in METRICS} for r in out["real_runs"][1:]]
    compare(out, "", simulate(FLAGS.model, workload, options, cost), run_steps[0], cost)
    out.update(drift_diagnostics(workload, options, cost, out, run_steps))
    return out, run_steps[0], rounds


def drift_diagnostics(workload: list, options: dict, cost, out: dict, run_steps: list) -> dict:
    """Where a simulator's error comes from, on this case (a diagnostic beside the errors, never instead of them):

    - "run_speeds": each real run's measured time over the profile's prediction on that run's own steps, i.e. how
      fast the machine ran during that run relative to its calibration (1 + the run's step-time error).
    - "elasticity": how many percent each simulated metric moves per percent on every step's time (the
      simulator with the profile times 0.95 and 1.05). A metric with elasticity E needs the step times within
      10% / E for a 10% error: the queue's amplification of the machine's drift.
    - "speed_matched": each real run against the simulator at that run's own speed (the profile times its
      run_speed: one number per run, taken from the run itself), the errors per run. What remains is the cost
      model's shape and the schedule, with the machine's overall speed during the run taken out."""
    from cbjax.sim import ScaledCost

    speeds = [sum(times) / sum(map(cost.step_time, feats)) for feats, times in run_steps]
    lo, hi = (simulate(FLAGS.model, workload, options, ScaledCost(cost, f)) for f in (0.95, 1.05))
    base = out["sim"]
    elasticity = {k: (hi[k] - lo[k]) / (0.10 * base[k]) for k in METRICS}
    matched = []
    for speed, real in zip(speeds, out["real_runs"], strict=True):
        sim = simulate(FLAGS.model, workload, options, ScaledCost(cost, speed))
        matched.append({k: sim[k] / real[k] - 1 for k in METRICS})
    return dict(run_speeds=speeds, elasticity=elasticity, speed_matched=matched)


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


def against_real_range(results: dict) -> str:
    """Each metric: the simulator (as fitted) against the median real run, and in brackets the real runs' own range
    around that median; * marks a simulated figure inside that range or within 10% of the median."""
    head = "| case | " + " | ".join(METRICS) + " |"
    lines = [head, "|" + "---|" * (len(METRICS) + 1)]
    for name, r in results.items():
        cells = []
        for k in METRICS:
            med = r["real_median"][k]
            lo, hi = (min(x[k] for x in r["real_runs"]) / med - 1, max(x[k] for x in r["real_runs"]) / med - 1)
            e = r["error_vs_median"][k]
            ok = "*" if lo - 1e-12 <= e <= hi + 1e-12 or abs(e) <= 0.10 else ""
            cells.append(f"{e:+.1%}{ok} [{lo:+.0%}, {hi:+.0%}]")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def drift_tables(results: dict) -> str:
    """The drift diagnostics of each case (drift_diagnostics), where the results have them."""
    cases = {n: r for n, r in results.items() if "speed_matched" in r}
    if not cases:
        return ""

    def metric_table(title: str, cell) -> list[str]:
        head = ["", title, "", "| case | " + " | ".join(METRICS) + " |", "|" + "---|" * (len(METRICS) + 1)]
        return head + [f"| {n} | " + " | ".join(cell(r, k) for k in METRICS) + " |" for n, r in cases.items()]

    def median_range(r: dict, k: str) -> str:
        e = [m[k] for m in r["speed_matched"]]
        return f"{statistics.median(e):+.1%} [{min(e):+.0%}, {max(e):+.0%}]"

    lines = ["Each real run's speed: measured / the profile's prediction on that run's own steps - 1:", "",
             "| case | runs |", "|---|---|"]  # fmt: skip
    lines += [f"| {n} | " + ", ".join(f"{s - 1:+.1%}" for s in r["run_speeds"]) + " |" for n, r in cases.items()]
    title = "Elasticity: percent a simulated metric moves per percent on every step's time (profile x0.95, x1.05):"
    lines += metric_table(title, lambda r, k: f"{r['elasticity'][k]:.2f}")
    title = ("Speed-matched (a diagnostic, not the acceptance figure): each real run against the simulator at that "
             "run's own speed; median of the per-run errors [min, max]:")  # fmt: skip
    return "\n".join(lines + metric_table(title, median_range))


def report(results: dict) -> str:
    first = next(iter(results.values()))
    parts = [
        "Simulator (as fitted) / the median real run - 1 [the real runs' own range around their median]:",
        against_real_range(results),
        table(results, "error", "step_time_error", "Simulator / the first real run - 1, the profile as fitted:"),
        table(results, "real_spread", None, "The real engine against itself (second real run / first - 1):"),
    ]
    if "sim_pooled" in first:
        title = "Simulator, one profile fitted on every case's calibration / the median real run - 1:"
        parts.append(table(results, "error_pooled_vs_median", "step_time_error_pooled", title))
    return "\n\n".join(p for p in [*parts, drift_tables(results)] if p)


def calibration_round(case: str, i: int):
    """The calibration sweep, now (never on a case's workload): round i of `case`'s calibration."""
    from cbjax.sim_calibration import calibrate

    load = os.getloadavg()[0]
    cal = calibrate(FLAGS.model, dict(ENGINE), seed=FLAGS.calibration_seed, scale=FLAGS.calibration_scale,
                    log=lambda s: None)  # fmt: skip
    if FLAGS.steps_output:
        from experiments.measured_steps import write_steps

        write_steps(os.path.join(FLAGS.steps_output, f"{case}_calibration{i}.jsonl"), cal.groups())
    print(f"{case}: calibration round {i}, {len(cal.times)} steps (load {load:.1f})", flush=True)
    return cal


def save_case_profile(case: str, cost) -> str:
    """Write the profile fitted for `case` next to the output; returns its path."""
    import datetime

    from cbjax.sim import save_profile
    from cbjax.sim.provenance import origin

    path = os.path.join(os.path.dirname(os.path.abspath(FLAGS.output)), "sim_fidelity_profiles", f"{case}.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    meta = dict(model=FLAGS.model, engine_options=dict(ENGINE), fitted_for_case=case,
                date=datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                load_average=list(os.getloadavg()), calibration_rounds=FLAGS.real_repeats,
                calibration_scale=FLAGS.calibration_scale, calibration_seed=FLAGS.calibration_seed,
                origin=origin())  # fmt: skip
    save_profile(cost, path, meta)
    return path


def main(argv):
    import sys

    from experiments import fidelity_study

    if FLAGS.report:
        with open(FLAGS.report) as f:
            saved = json.load(f)
        print(report(saved["cases"]) if "cases" in saved else fidelity_study.report(saved))
        return
    if FLAGS.mode == "cases":
        return main_cases(argv)
    if FLAGS.cases or FLAGS.recalibrate:
        raise app.UsageError("--cases and --recalibrate belong to the per-case protocol: add --mode=cases")
    output = FLAGS.output or fidelity_study.default_output()
    fidelity_study.study_command(FLAGS.profile or "auto", output=output, repeats=FLAGS.repeats, scale=FLAGS.scale,
                                 model=FLAGS.model, steps_output=FLAGS.steps_output, probe=FLAGS.probe,
                                 argv=sys.argv)  # fmt: skip


def main_cases(argv):
    """The per-case protocol (--mode=cases)."""
    del argv
    from cbjax.sim import CalibratedCost, read_profile
    from cbjax.sim.provenance import check_origin
    from experiments.measured_steps import write_steps

    if not FLAGS.output:
        FLAGS.output = "results/sim_fidelity.json"
    names = FLAGS.cases or list(CASES)
    unknown = sorted(set(names) - set(CASES))
    if unknown:
        raise app.UsageError(f"unknown cases {unknown}; known: {list(CASES)}")
    if FLAGS.recalibrate == (FLAGS.profile is not None):
        raise app.UsageError("give exactly one of --profile and --recalibrate")
    if FLAGS.profile:  # a profile from another machine or tree measures the fit's age, not the simulator
        check_origin(FLAGS.profile, read_profile(FLAGS.profile))
    if FLAGS.steps_output:
        os.makedirs(FLAGS.steps_output, exist_ok=True)
    load = list(os.getloadavg())
    results, calibration, real_steps = {}, ([], []), {}
    for name in names:
        workload = case_workload(FLAGS.model, CASES[name][0], FLAGS.scale)
        results[name], real_steps[name], rounds = run_case(name, FLAGS.profile, workload, CASES[name][1])
        calibration[0].extend(rounds[0])
        calibration[1].extend(rounds[1])
        if FLAGS.steps_output:
            write_steps(os.path.join(FLAGS.steps_output, f"{name}_real.jsonl"), {"real": real_steps[name]})
        results[name].update(load_average=list(os.getloadavg()))
        r = results[name]
        print(name, json.dumps(r["error_vs_median"]), "step times", r["step_time_error"], flush=True)
    if FLAGS.recalibrate and len(names) > 1:
        # Every case's calibration sweep in one fit: the machine's typical speed over the whole sitting, the
        # counterpart of the median real run.
        pooled = CalibratedCost.fit(*calibration)
        for name in names:
            workload = case_workload(FLAGS.model, CASES[name][0], FLAGS.scale)
            sim = simulate(FLAGS.model, workload, CASES[name][1], pooled)
            compare(results[name], "_pooled", sim, real_steps[name], pooled)
    os.makedirs(os.path.dirname(os.path.abspath(FLAGS.output)), exist_ok=True)
    with open(FLAGS.output, "w") as f:
        json.dump(dict(profile=FLAGS.profile, recalibrate=FLAGS.recalibrate, calibration_scale=FLAGS.calibration_scale,
                       real_repeats=FLAGS.real_repeats, cpu=cpu_model(),
                       load_average_before=load, load_average_after=list(os.getloadavg()),
                       cases=results), f, indent=1)  # fmt: skip
    print(report(results))
    print(f"written: {FLAGS.output}")


if __name__ == "__main__":
    app.run(main)
