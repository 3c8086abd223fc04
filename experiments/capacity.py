"""Capacity under SLOs: for each policy, the highest arrival rate at which at least `capacity_search.target` of the
requests (default 90%) meet the config's SLOs (config.slo: TTFT, TPOT, optionally E2E), by bisection on the rate
(cbjax/bench/capacity_search.py), then, optionally, the found rate checked on the real engine.

  python -m experiments.capacity --config=configs/capacity_zoo.py                    # the zoo on the simulator
  python -m experiments.capacity --config=configs/capacity_zoo.py --config.capacity_search.real_check=True

The search runs the config's engine (the simulator in capacity_zoo.py: minutes for the whole zoo) on the same
requests at each rate: only their arrival times move. The first guess is the offline capacity of
config.capacity.policy. Each of config.seeds workload seeds is searched on its own; the table gives the median
capacity [95% interval over seeds]. The real check (capacity_search.real_check) runs the real engine
(engine.runner="model", each step's measured time on a virtual clock, as policy_zoo.py) at the found rate and
`real_factor` times it, config.repeats times each, interleaved, and reports the attainment there: the simulator's
capacity holds on the real engine when the attainment at the rate meets the target and the one above misses it.

Writes <output_dir>/<run_name>/: capacity.json (every probe of every search, the checks), capacity.png (SLO
attainment and goodput against the rate, one line per policy), and with config.doc_data a data file for the docs.
"""

from __future__ import annotations

import datetime
import math
import os
import sys

from absl import app, flags

from cbjax.bench.capacity_search import Probe, search_capacity
from cbjax.bench.intervals import format_interval, median_interval
from experiments import compare_policies as cp
from experiments.load_harness import workload_config

FLAGS = flags.FLAGS
PROBE_FIGURES = ("slo_attainment", "goodput", "request_throughput", "output_throughput", "ttft_ms_p50",
                 "ttft_ms_p99", "tpot_ms_p50", "e2e_ms_p50")  # fmt: skip


def search_settings(cfg) -> dict:
    """config.capacity_search, checked, with its defaults."""
    s = dict(target=0.9, tolerance=0.02, max_probes=16, real_check=False, real_factor=1.1, real_policies=None)
    s.update({k: v for k, v in (cfg.get("capacity_search") or {}).items() if v is not None})
    if not 0.0 < s["target"] <= 1.0:
        raise ValueError(f"config.capacity_search.target must be a share in (0, 1], got {s['target']!r}")
    if not s["real_factor"] > 1.0:
        raise ValueError(f"config.capacity_search.real_factor must be > 1, got {s['real_factor']!r}")
    if isinstance(s["real_policies"], str):
        s["real_policies"] = [p.strip() for p in s["real_policies"].split(",") if p.strip()]
    unknown = sorted(set(s["real_policies"] or ()) - set(cfg.policies))
    if unknown:
        raise ValueError(f"config.capacity_search.real_policies names policies not in config.policies: {unknown}")
    if not any(v is not None for v in cfg.slo.to_dict().values()):
        raise ValueError(
            "config.slo sets no bound: capacity under an SLO needs at least one of ttft_ms, tpot_ms, e2e_ms"
        )
    return s


def measured(cfg, name: str, seed_offset: int, rate: float, *, progress: bool = False) -> Probe:
    """Entry `name` through the workload of seed `seed_offset` arriving at `rate`, every request to its end."""
    from cbjax.bench.metrics import summarize
    from cbjax.bench.workload import make_workload

    workload = make_workload(workload_config(cfg, seed_offset=seed_offset, request_rate=rate))
    _, res = cp.run_once(cfg, name, workload, desc=f"{name} @ {rate:.3g}/s", progress=progress)
    if res.interrupted:
        raise KeyboardInterrupt
    slo = {k: v for k, v in cfg.slo.to_dict().items() if v is not None}
    s = summarize(res.requests, res.steps, slo=slo)
    return Probe(rate, s["slo_attainment"], {k: s.get(k) for k in PROBE_FIGURES})


def search_all(cfg, settings: dict, start_rate: float) -> dict:
    """policy -> one SearchResult per workload seed."""
    out = {}
    for name in cfg.policies:
        out[name] = []
        for seed in range(cfg.get("seeds", 1)):
            res = search_capacity(lambda r, n=name, s=seed: measured(cfg, n, s, r), start_rate,
                                  target=settings["target"], tolerance=settings["tolerance"],
                                  max_probes=settings["max_probes"])  # fmt: skip
            print(f"{name} (seed {seed}): {res.capacity:.3g} req/s{'' if res.bounded else ' or more'} "
                  f"after {len(res.probes)} runs", file=sys.stderr)  # fmt: skip
            out[name].append(res)
    return out


def real_config(cfg):
    """The config on the real engine: the model's steps, timed, on a virtual clock (no sleeping between arrivals)."""
    real = cfg.copy_and_resolve_references()
    real.engine.runner = "model"
    real.clock, real.step_cost_ms = "virtual", 0.0
    return real


def check_on_real(cfg, settings: dict, capacities: dict) -> dict:
    """policy -> {"rate", "above", "at": [attainment per repeat], "above_runs": [...]} on the real engine,
    the policies and the two rates interleaved within each repeat."""
    real = real_config(cfg)
    names = settings["real_policies"] or list(capacities)
    out = {n: {"rate": capacities[n], "above": capacities[n] * settings["real_factor"], "at": [], "above_runs": []}
           for n in names}  # fmt: skip
    for rep in range(cfg.get("repeats", 1)):
        for name, check in out.items():
            if check["rate"] <= 0:
                continue
            for key, rate in (("at", check["rate"]), ("above_runs", check["above"])):
                check[key].append(measured(real, name, 0, rate).attainment)
                print(f"real check {name} #{rep + 1} @ {rate:.3g}/s: {check[key][-1]:.3f}", file=sys.stderr)
    return out


def table(results: dict, settings: dict, checks: dict | None) -> str:
    """The printed table: per policy the capacity (median [interval] over seeds), runs, and the real check."""
    target = settings["target"]
    header = ["policy", f"capacity at {target:.0%} in SLO (req/s)", "searches", "runs"]
    if checks:
        header += ["real: in SLO at it", f"real: at {settings['real_factor']:g}x", "holds"]
    rows = [" | ".join(header), " | ".join("---" for _ in header)]
    for name, searches in results.items():
        caps = [r.capacity for r in searches]
        cap = format_interval(median_interval(caps), "{:.3g}") + ("" if all(r.bounded for r in searches) else "+")
        row = [name, cap, str(len(searches)), str(sum(len(r.probes) for r in searches))]
        if checks and name not in checks:
            row += ["-", "-", "not checked"]
        elif checks:
            c = checks[name]
            at, above = median_interval(c["at"]), median_interval(c["above_runs"])
            holds = "-" if not c["at"] else ("yes" if at.median >= target > above.median else "no")
            row += [format_interval(at, "{:.2f}"), format_interval(above, "{:.2f}"), holds]
        rows.append(" | ".join(row))
    return "\n".join(f"| {r} |" for r in rows)


def plot(path: str, results: dict) -> str:
    from cbjax.bench.plots import plot_load_curves

    rows = [{"policy": name, "rate": p.rate, **p.figures} for name, searches in results.items()
            for p in searches[0].probes]  # fmt: skip
    return plot_load_curves(path, rows, curves=(("slo_attainment", "share in SLO"), ("goodput", "goodput (req/s)")))


def main(argv):
    del argv
    from cbjax.bench import results as results_files
    from cbjax.bench.workload import make_workload

    start_time = datetime.datetime.now().astimezone()
    try:
        cfg = cp.resolve_config(cp.load_config())
        settings = search_settings(cfg)
    except ValueError as e:
        sys.exit(f"capacity: {e}")
    folder = results_files.run_dir(cfg.output_dir, cfg.run_name, overwrite=cfg.get("overwrite", False))
    results_files.write_config(os.path.join(folder, "config.json"), cfg)
    offline = cp.measure_capacity(cfg, make_workload(workload_config(cfg, offline=True)))
    print(
        f"first guess: {cp.capacity_policy(cfg)}'s offline capacity, {offline.request_rate:.3g} req/s", file=sys.stderr
    )
    results = search_all(cfg, settings, offline.request_rate)
    capacities = {n: float(median_interval([r.capacity for r in s]).median) for n, s in results.items()}
    checks = check_on_real(cfg, settings, capacities) if settings["real_check"] else None
    print(table(results, settings, checks))
    report = {
        "settings": settings,
        "slo": cfg.slo.to_dict(),
        "offline_capacity": offline.to_dict(1.0),
        "searches": {
            n: [
                {
                    "capacity": r.capacity,
                    "bounded": r.bounded,
                    "probes": [{"rate": p.rate, "attainment": p.attainment, **p.figures} for p in r.probes],
                }
                for r in s
            ]
            for n, s in results.items()
        },
        "real_check": checks,
        "start_time": start_time.isoformat(timespec="seconds"),
    }
    results_files.write_json(os.path.join(folder, "capacity.json"), report)
    plot(os.path.join(folder, "capacity.png"), results)
    if cfg.get("doc_data"):
        from cbjax.bench.doc_data import write_doc_data

        # One record per search (kind "search": a policy's capacity on one seed) and per real-check run (kind
        # "real": the attainment at the capacity, factor 1, or above it), so the views take medians of either.
        runs = [{"kind": "search", "policy": n, "seed": i, "capacity": r.capacity, "bounded": r.bounded,
                 "probes": len(r.probes)} for n, s in results.items() for i, r in enumerate(s)]  # fmt: skip
        for n, c in (checks or {}).items():
            for factor, key, rate in ((1.0, "at", c["rate"]), (settings["real_factor"], "above_runs", c["above"])):
                runs += [{"kind": "real", "policy": n, "factor": factor, "rate": rate, "run": k + 1, "attainment": a}
                         for k, a in enumerate(c[key])]  # fmt: skip
        write_doc_data(cfg.doc_data, command=" ".join(["python -m experiments.capacity", *sys.argv[1:]]), runs=runs,
                       settings=settings, slo=cfg.slo.to_dict())  # fmt: skip
    print(f"results: {folder}")
    return 0 if all(math.isfinite(c) for c in capacities.values()) else 1


if __name__ == "__main__":
    app.run(main, flags_parser=cp.parse_flags)
