"""The simulator-fidelity study (issue 35, point 3): is the simulator good enough to compare policies with?

  python -m experiments.fidelity_study --profile=configs/profiles/PROFILE.json [--repeats 5] [--scale 1.0] \
      [--output docs/data/sim_fidelity_study_<date>.json] [--steps_output DIR]
  python -m experiments.fidelity_study --report docs/data/sim_fidelity_study_<date>.json   # the tables again

On requests the calibration never saw (the chat/RAG/code mix; the calibration sweeps uniform synthetic lengths,
seeds 1234-1236), three workloads on the same requests: offline (all at t=0), near saturation (Poisson at load
0.9) and overload (load 1.3), the loads relative to fcfs's capacity measured by the offline workload's fcfs runs
(cbjax/bench/capacity.py), which therefore runs first. Each workload: `repeats` rounds of real runs, every policy
once per round, interleaved (round r starts r policies later) so a slow minute of the machine falls on all of them;
a fresh, warmed engine each run, on a virtual clock advanced by each step's measured time
(experiments/measured_steps.py), each run right after a speed probe (cbjax/sim_calibration.py: fixed steps timed
against the cost model's prediction). Then each policy once on the simulator with the given cost model times the
median of the workload's probes (--noprobe: the cost model as given), on the same requests and arrival times
(deterministic). The figures and targets are experiments/fidelity_stats.py's.

The JSON records the command, commit, CPU, date, load averages, the profile and its meta, every real run's
summary, the step statistics, the simulated figures and the verdicts; the tables are rendered from that file
(`report`), so the docs can be regenerated from it. `--steps_output` writes every real step as JSONL.
"""

import dataclasses
import datetime
import json
import math
import os
import statistics
import sys
import time

from experiments import fidelity_stats as fs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
POLICIES = ("fcfs", "static", "sarathi", "sjf", "mlfq")  # none needs options beyond the engine's
# The mix at 1/8 lengths, a seed no other study uses; make_workload's fields (arrival and rate set per workload).
WORKLOAD = dict(kind="mixed", scale=0.125, seed=11, num_requests=300)
OFFLINE = "offline"
LOADS = {"near_saturation": 0.9, "overload": 1.3}  # workload name -> load (x the capacity policy's offline rate)
CAPACITY_POLICY = "fcfs"
RUN_KEYS = (*fs.METRICS, "request_throughput", "num_completed", "request_preemptions")
LABELS = dict(output_throughput="out tok/s", ttft_ms_p50="TTFT p50", ttft_ms_p99="TTFT p99",
              tpot_ms_p50="TPOT p50", e2e_ms_p50="E2E p50")  # fmt: skip


def engine_options(overrides: dict | None = None) -> dict:
    """configs/base.py's engine section (32 slots, 256-token budget, 1024 pages of 16 tokens, max_model_len 1024,
    float32, static's 0.5 s batch timeout), with `overrides` on top; the policy is set per run."""
    from cbjax.bench.config_files import sibling_config

    base = os.path.join(ROOT, "configs", "base.py")
    return {**sibling_config(base, "base.py").engine.to_dict(), **(overrides or {})}


def study_workload(model: str, fields: dict, max_model_len: int, request_rate: float | None = None) -> list:
    """The study's requests: offline, or Poisson at `request_rate` (the same requests either way: make_workload
    draws lengths and tokens from streams of their own)."""
    from cbjax.bench.workload import make_workload
    from cbjax.model.registry import model_config_of

    arrival = dict(arrival="offline") if request_rate is None else dict(arrival="poisson", request_rate=request_rate)
    vocab = model_config_of(model).vocab_size
    return make_workload(dict(fields, **arrival, vocab_size=vocab, max_model_len=max_model_len))


def run_summary(result) -> dict:
    from cbjax.bench.metrics import summarize

    s = summarize(result.requests, result.steps)
    return {k: s[k] for k in RUN_KEYS}


def real_run(model: str, workload: list, options: dict) -> tuple[list, list, dict]:
    """One run on a fresh real engine, warmed before timing: its steps' features and measured seconds, and its
    summary."""
    from cbjax.core.clock import VirtualClock
    from cbjax.engine import LLMEngine
    from experiments.measured_steps import measure

    engine = LLMEngine(model, clock=VirtualClock(), **options)
    engine.wait_until_warm()
    feats, times, result = measure(engine, workload)
    return feats, times, run_summary(result)


def sim_run(model: str, workload: list, options: dict, cost) -> dict:
    from cbjax.bench.online import run_online
    from cbjax.core.clock import VirtualClock
    from cbjax.engine import LLMEngine

    engine = LLMEngine(model, clock=VirtualClock(), cost_model=cost, **dict(options, runner="sim"))
    return run_summary(run_online(engine, workload))


def measure_workload(model, workload, policies, repeats, options, cost, log, probe=None) -> tuple[list, dict, list]:
    """The real runs (interleaved rounds; each a dict of policy, round, summary, features, times, wall seconds),
    the simulator's summary per policy, and the speed probes. With `probe` (a function of no arguments returning a
    SpeedProbe, cbjax/sim_calibration.py), one runs right before each real run, and the simulator runs `cost` scaled
    by the median of the workload's probes: the profile at the speed of the minutes these runs were measured in.
    (One probe per round was tried first: 5 probes of 2-3 s each spread 0.75-1.31 in a busy sitting, and their
    median missed the overload workload's speed by 9%.)"""
    runs, probes = [], []
    for rnd in range(repeats):
        k = rnd % len(policies)
        for policy in policies[k:] + policies[:k]:
            if probe is not None:
                probes.append(probe().as_dict())
            t0 = time.perf_counter()
            feats, times, summary = real_run(model, workload, dict(options, policy=policy))
            wall = time.perf_counter() - t0
            runs.append(dict(policy=policy, round=rnd, summary=summary, features=feats, times=times, wall_s=wall))
            probed = f"; probe before it {probes[-1]['scale']:.3f}" if probe is not None else ""
            log(f"  round {rnd} {policy}: {len(times)} steps, {sum(times):.2f} s measured, {wall:.1f} s wall{probed}")
    sim = {p: sim_run(model, workload, dict(options, policy=p), probed_cost(cost, probes)) for p in policies}
    return runs, sim, probes


def probed_cost(cost, probes: list):
    """`cost` scaled by the median of the probes' measured / predicted (itself when there are none)."""
    from cbjax.sim.cost_model import ScaledCost

    if not probes:
        return cost
    return ScaledCost(cost, statistics.median(p["scale"] for p in probes))


def speed_probe(model: str, options: dict, cost):
    """A warm real engine with the study's engine options (fcfs) kept for the whole study, and a function that runs
    the speed probe on it against `cost`."""
    from cbjax.core.clock import VirtualClock
    from cbjax.engine import LLMEngine
    from cbjax.sim_calibration import probe_speed

    engine = LLMEngine(model, clock=VirtualClock(), **dict(options, policy="fcfs"))
    engine.wait_until_warm()
    return lambda: probe_speed(engine, cost)


def analyze_workload(runs: list, sim: dict, policies, step_time) -> dict:
    """Step level, metric level and ranking of one workload (experiments/fidelity_stats.py)."""
    by_round = {p: [r["summary"] for r in sorted(runs, key=lambda r: r["round"]) if r["policy"] == p] for p in policies}
    metrics = {p: {m: fs.metric_check([s[m] for s in by_round[p]], sim[p][m]) for m in fs.METRICS} for p in policies}
    ranking = {
        m: fs.ranking({p: [s[m] for s in by_round[p]] for p in policies}, {p: sim[p][m] for p in policies})
        for m in fs.METRICS
    }
    return dict(steps=fs.step_level(runs, step_time), metrics=metrics, ranking=ranking)


def run_study(model: str, cost, *, policies=POLICIES, repeats: int = 5, workload: dict = WORKLOAD,
              loads: dict = LOADS, engine: dict | None = None, capacity_policy: str = CAPACITY_POLICY,
              steps_output: str | None = None, probe: bool = True, log=print) -> dict:  # fmt: skip
    """The whole study with cost model `cost` (anything with step_time(StepFeatures)); `engine` overrides
    engine_options(). With `probe`, each workload's simulation and step statistics use `cost` scaled by speed
    probes taken before each of its real runs (measure_workload). Returns the study's dict (settings, capacity,
    workloads, verdicts), without provenance."""
    from cbjax.bench.capacity import capacity_of
    from cbjax.core.policy_zoo import POLICIES as KNOWN
    from experiments.measured_steps import write_steps

    policies = tuple(policies)
    unknown = sorted(set(policies) - set(KNOWN))
    if unknown or capacity_policy not in policies or repeats < 1:
        raise ValueError(f"policies {policies} (unknown: {unknown}) must include {capacity_policy!r}; repeats >= 1")
    options = engine_options(engine)
    max_len = options["max_model_len"]
    out = dict(settings=dict(model=model, policies=list(policies), repeats=repeats, workload=workload, loads=loads,
                             capacity_policy=capacity_policy, engine=options, probe=probe), workloads={})  # fmt: skip
    rates = {OFFLINE: None}
    prober = speed_probe(model, options, cost) if probe else None
    for name in (OFFLINE, *loads):
        requests = study_workload(model, workload, max_len, rates.get(name))
        log(f"{name}: {len(requests)} requests" + (f" at {rates[name]:.2f}/s" if rates.get(name) else " at t=0"))
        runs, sim, probes = measure_workload(model, requests, policies, repeats, options, cost, log, prober)
        wcost = probed_cost(cost, probes)
        if name == OFFLINE:  # the capacity the online workloads' loads are relative to
            cap = capacity_of(capacity_policy, [r["summary"] for r in runs if r["policy"] == capacity_policy],
                              len(requests))  # fmt: skip
            rates.update({n: cap.rate_at(load) for n, load in loads.items()})
            out["capacity"] = dict(dataclasses.asdict(cap), rates=rates)
        if steps_output:
            os.makedirs(steps_output, exist_ok=True)
            groups = {f"{r['policy']}/{r['round']}": (r["features"], r["times"]) for r in runs}
            write_steps(os.path.join(steps_output, f"{name}.jsonl"), groups)
        w = out["workloads"][name] = dict(load=loads.get(name), request_rate=rates[name], num_requests=len(requests),
                                          probes=probes, scale=getattr(wcost, "factor", 1.0))  # fmt: skip
        w.update(analyze_workload(runs, sim, policies, wcost.step_time), sim=sim)
        w["runs"] = [dict(policy=r["policy"], round=r["round"], summary=r["summary"], wall_s=r["wall_s"],
                          steps=len(r["times"]), measured_s=sum(r["times"]),
                          predicted_s=sum(map(wcost.step_time, r["features"]))) for r in runs]  # fmt: skip
    out["verdicts"] = fs.verdicts(out["workloads"])
    return out


def load_cost(profile: str, model: str = "llama-tiny") -> tuple[object, dict]:
    """The cost model of a profile file, or of "auto" (this machine's cached calibration for the study's engine,
    calibrated now if there is none: cbjax/sim/auto_profile.py), and what the study records of it."""
    from cbjax.sim import AUTO_PROFILE, load_profile

    if profile == AUTO_PROFILE:
        from cbjax.core.clock import VirtualClock
        from cbjax.engine import LLMEngine

        options = engine_options(dict(policy="fcfs", runner="sim", sim_profile=AUTO_PROFILE))
        engine = LLMEngine(model, clock=VirtualClock(), **options)
        cost = engine.runner.cost_model
        return cost, dict(path=AUTO_PROFILE, kind=cost.kind, meta=None, model=cost.to_dict())
    from cbjax.sim.provenance import check_origin

    with open(profile) as f:
        d = json.load(f)
    check_origin(profile, d)  # a profile from another machine or tree measures the fit's age, not the simulator
    return load_profile(profile), dict(path=profile, kind=d.get("kind"), meta=d.get("meta"))


# ---- tables, from the study's JSON (NaN written as null) ----


def _num(x) -> float:
    return math.nan if x is None else float(x)


def _pct(x, digits: int = 1) -> str:
    x = _num(x)
    return "-" if not math.isfinite(x) else f"{x:+.{digits}%}"


def _size(x) -> str:
    """An unsigned share (an error's size)."""
    x = _num(x)
    return "-" if not math.isfinite(x) else f"{x:.1%}"


def step_table(study: dict) -> str:
    """Step level, per workload: all steps, by kind of step and by policy."""
    lines = ["Step level: the cost model on the real runs' own steps (bias: summed predicted / summed measured - 1; "
             "error: |predicted / measured - 1|; noise: |t / median - 1| over groups of >= 3 identical steps).", "",
             "| workload | slice | steps | share of time | bias | error, median (mean) | repeated steps (groups) "
             "| error on them, median | engine's own noise, median (mean) |", "|" + "---|" * 9]  # fmt: skip
    for name, w in study["workloads"].items():
        s = w["steps"]
        rows = [("all", s["all"]), *s["by_class"].items(), *((f"policy {p}", v) for p, v in s["by_policy"].items())]
        for label, v in rows:
            cells = [name, label, v["steps"], f"{_num(v['time_share']):.0%}", _pct(v["bias"]),
                     f"{_size(v['error_median'])} ({_size(v['error_mean'])})",
                     f"{v['repeated_steps']} ({v['repeated_groups']})", _size(v["repeated_error_median"]),
                     f"{_size(v['noise_median'])} ({_size(v['noise_mean'])})"]  # fmt: skip
            lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)


def run_bias_line(study: dict) -> str:
    """Per workload, the bias of each real run on its own steps (min to max, median), and the widest spread between
    the rounds of one policy: runs of one policy differ only by the machine's drift, which one profile cannot
    follow."""
    parts = []
    for name, w in study["workloads"].items():
        by_policy: dict[str, list[float]] = {}
        for r in w["runs"]:
            if _num(r["measured_s"]) > 0:
                by_policy.setdefault(r["policy"], []).append(_num(r["predicted_s"]) / _num(r["measured_s"]) - 1)
        b = sorted(x for v in by_policy.values() for x in v)
        if b:
            widest = max(by_policy, key=lambda p: max(by_policy[p]) - min(by_policy[p]))
            spread = max(by_policy[widest]) - min(by_policy[widest])
            parts.append(f"{name} {_pct(b[0])} to {_pct(b[-1])} (median {_pct(statistics.median(b))}, {len(b)} runs; "
                         f"one policy's rounds up to {spread * 100:.0f} points apart, {widest})")  # fmt: skip
    return "Bias per real run (the cost model on one run's steps): " + "; ".join(parts) + "."


def probe_line(study: dict) -> str:
    """Per workload, the speed probes' measured / predicted (the profile's error on the probe's fixed steps in these
    minutes) and the scale the simulator ran with, or that it ran the profile as calibrated."""
    if not study["settings"].get("probe"):
        return "Speed probes: none (the profile as calibrated)."
    parts, when = [], set()
    for name, w in study["workloads"].items():
        scales = [p["scale"] for p in w.get("probes", [])]
        # One probe per real run; the first sittings with probes took one per round.
        when.add("each real run" if len(scales) == len(w["runs"]) else "each round")
        parts.append(f"{name} {min(scales):.3f}-{max(scales):.3f} over {len(scales)} probes, scale {w['scale']:.3f}")
    head = f"Speed probes (measured / predicted on the probe's fixed steps, before {' or '.join(sorted(when))}; the "
    return (
        head + "simulator and the bias above use the profile times each workload's median): " + "; ".join(parts) + "."
    )


def metric_table(study: dict) -> str:
    """Metric level: each simulated figure / the real median - 1, [the real 95% interval around that median];
    ✓ inside the interval or within the tolerance."""
    tol = study["verdicts"]["metric_figures"]["tolerance"]
    lines = [f"Metric level: simulated / real median - 1 [the real runs' 95% interval, around their median]; "
             f"✓ inside the interval or within {tol:.0%}.", "",
             "| workload | policy | " + " | ".join(LABELS[m] for m in fs.METRICS) + " |",
             "|" + "---|" * (2 + len(fs.METRICS))]  # fmt: skip
    for name, w in study["workloads"].items():
        for policy, per in w["metrics"].items():
            cells = []
            for m in fs.METRICS:
                c = per[m]
                med = _num(c["median"])
                lo, hi = (_num(c["low"]) / med - 1, _num(c["high"]) / med - 1) if med else (math.nan, math.nan)
                cells.append(f"{_pct(c['error'])} [{_pct(lo, 0)}, {_pct(hi, 0)}] {'✓' if c['ok'] else '✗'}")
            lines.append(f"| {name} | {policy} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def ranking_table(study: dict) -> str:
    """Ranking: per workload and metric, the pairs the real runs separate and how many the simulator orders alike;
    every pair it does not (reversed or tied) with the real paired ratio [interval] and the simulated ratio."""
    lines = ["Ranking: pairs of policies the real runs' paired ratio interval separates; Kendall's tau over them "
             "((same order - reversed) / separable).", "",
             "| workload | metric | pairs | separable | same order | reversed | tied in sim | tau | pairs not in the "
             "real order (a/b: real [95%], sim) |", "|" + "---|" * 9]  # fmt: skip

    def row(name, label, k, pairs):
        missed = [p for p in pairs if p["separable"] and p["sim_order"] != "same"]
        text = "; ".join(f"{p['a']}/{p['b']}: {_num(p['ratio']):.3f} [{_num(p['ratio_low']):.3f}, "
                         f"{_num(p['ratio_high']):.3f}], sim {_num(p['sim_ratio']):.3f}" for p in missed)  # fmt: skip
        tau = "-" if not math.isfinite(_num(k["tau"])) else f"{_num(k['tau']):.2f}"
        cells = [name, label, k["pairs"], k["separable"], k["same_order"], k["reversed"], k["tied"], tau, text or "-"]
        lines.append("| " + " | ".join(map(str, cells)) + " |")

    for name, w in study["workloads"].items():
        for m, r in w["ranking"].items():
            row(name, LABELS[m], r, r["pair_list"])
        pooled = [p for r in w["ranking"].values() for p in r["pair_list"]]
        row(name, "**all**", fs.kendall(pooled), [])
    return "\n".join(lines)


def verdict_lines(study: dict) -> list[str]:
    """One line per target: met, or missed by how much; and the study's scope against the issue's."""
    v = study["verdicts"]
    b, f, r = v["step_bias"], v["metric_figures"], v["ranking"]

    def mark(t, missed: str) -> str:
        return "**met**" if t["met"] else f"**missed** ({missed})"

    s = study["settings"]
    scope_ok = len(s["policies"]) >= 5 and len(study["workloads"]) >= 3
    return [
        f"- Step-level bias within ±{b['target']:.0%} on every held-out workload: "
        + mark(b, f"by {_num(b['missed_by']) * 100:.1f} points")
        + ": "
        + ", ".join(f"{n} {_pct(x)}" for n, x in b["per_workload"].items())
        + f" (worst: {b['worst_workload']})",
        f"- Figures inside the real 95% interval or within {f['tolerance']:.0%} of the median: {f['ok']} of "
        f"{f['figures']} ({_num(f['share']):.0%}; target ≥ {f['target']:.0%}): "
        + mark(f, f"by {_num(f['missed_by']) * 100:.1f} points"),
        f"- Ranking: {r['same_order']} of {r['separable']} separable pairs (of {r['pairs']}) in the real order, "
        f"tau {_num(r['tau']):.2f}: "
        + mark(r, f"{r['reversed']} reversed, {r['tied']} tied" if r["separable"] else "no separable pair"),
        f"- Scope: {len(s['policies'])} policies ({', '.join(s['policies'])}), {len(study['workloads'])} workloads, "
        f"{s['repeats']} real rounds" + ("" if scope_ok else " (below the issue's 5 policies and 3 workloads)"),
    ]


def report(study: dict) -> str:
    parts = [step_table(study), run_bias_line(study), probe_line(study), metric_table(study), ranking_table(study)]
    return "\n\n".join([*parts, "\n".join(verdict_lines(study))])


def study_command(profile: str, *, output: str, repeats: int = 5, scale: float = 1.0, model: str = "llama-tiny",
                  policies=POLICIES, workload: dict = WORKLOAD, engine: dict | None = None,
                  steps_output: str | None = None, probe: bool = True, argv=None) -> dict:  # fmt: skip
    """Run the study, write its JSON with provenance to `output`, print the tables from the written file.
    `scale` multiplies `workload`'s number of requests; `engine` overrides engine_options(); `probe`: speed probes
    (run_study)."""
    from cbjax.bench.results import cpu_model, manifest, write_json

    argv = list(sys.argv if argv is None else argv)
    start = datetime.datetime.now(datetime.UTC)
    load_before = list(os.getloadavg())
    cost, profile_info = load_cost(profile, model)
    workload = dict(workload, num_requests=max(10, round(workload["num_requests"] * scale)))
    study = run_study(model, cost, policies=policies, repeats=repeats, workload=workload, engine=engine,
                      steps_output=steps_output, probe=probe)  # fmt: skip
    prov = manifest(start_time=start, engines={}, argv=argv)
    study = dict(command="python -m experiments.fidelity_study " + " ".join(argv[1:]), commit=prov["git"],
                 cpu=cpu_model(), date=start.isoformat(timespec="seconds"), load_average_before=load_before,
                 load_average_after=list(os.getloadavg()), wall_s=(datetime.datetime.now(datetime.UTC) - start)
                 .total_seconds(), profile=profile_info, manifest=prov, **study)  # fmt: skip
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    write_json(output, study)
    with open(output) as f:
        saved = json.load(f)
    print(report(saved))
    print(f"written: {output}")
    return saved


def default_output() -> str:
    """docs/data/sim_fidelity_study_<today>.json."""
    return f"docs/data/sim_fidelity_study_{datetime.date.today().isoformat()}.json"


def define_flags() -> None:
    """The command's flags, defined only when it runs as the program (experiments.sim_fidelity, which calls
    study_command, has flags of the same names)."""
    from absl import flags

    flags.DEFINE_string("profile", None, "cost-model profile (JSON, experiments/calibrate.py), or auto (cached)")
    flags.DEFINE_integer(
        "repeats",
        5,
        "real rounds per workload, every policy once per round (3 leave ~1 in 4 inseparable pairs looking separable)",
    )
    flags.DEFINE_float("scale", 1.0, "multiplies the workload's number of requests")
    flags.DEFINE_string("model", "llama-tiny", "the model the profile was calibrated for")
    flags.DEFINE_list("policies", list(POLICIES), "policies compared (must include fcfs, the capacity's reference)")
    flags.DEFINE_string("output", default_output(), "where the study's JSON goes")
    flags.DEFINE_string("steps_output", None, "a folder: every real run's steps as JSONL, one file per workload")
    flags.DEFINE_string("report", None, "print the tables of a saved study (its JSON) and exit")
    flags.DEFINE_bool("probe", True, "scale the profile by speed probes timed before each real run (run_study)")


def main(argv) -> None:
    from absl import app, flags

    f = flags.FLAGS
    if f.report:
        with open(f.report) as fh:
            print(report(json.load(fh)))
        return
    if not f.profile:
        raise app.UsageError("--profile is required (or --report)")
    del argv  # absl has taken the flags out of it; the record needs the whole command line
    study_command(f.profile, output=f.output, repeats=f.repeats, scale=f.scale, model=f.model,
                  policies=f.policies, steps_output=f.steps_output, probe=f.probe, argv=sys.argv)  # fmt: skip


if __name__ == "__main__":
    from absl import app

    define_flags()
    app.run(main)
