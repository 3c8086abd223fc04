"""Latency against load: the compare_policies run repeated at each load of `config.sweep.loads`, meant for the
simulator (seconds per point). A load is a fraction of the capacity of the reference policy (`config.capacity.policy`,
fcfs by default: its completed requests per second with the sweep's requests all queued at t=0, measured once before
the sweep, on the same engine; cbjax/bench/capacity.py), so the sweep names the same regimes on any profile,
machine or accelerator. `config.sweep.rates` sweeps absolute arrival rates (requests/s) instead; set one of the two.
With `config.seeds = N` every point runs on N workload seeds (the capacity is seed 0's), so the figures get
intervals over the workload's randomness.

Writes results/<run_name>/: config.json, sweep.csv, sweep.json (one row per load, policy and seed: the summary's
metrics) and load_curves.png (TTFT, TPOT, E2E and throughput against the arrival rate, medians over the seeds).
`--doc_data=PATH` also writes every run, raw, as a data file for the docs (cbjax/bench/doc_data.py).

  python -m experiments.sim_sweep --config=configs/sim_sweep.py [--config.sweep.loads=0.5,1,1.5] \\
      [--doc_data=docs/data/sim_sweep_DATE.json]

Any config of experiments/compare_policies works, given a `sweep` entry; on the real engine each point takes as long
as a compare_policies run.
"""

import csv
import os
import statistics
import sys

from absl import app, flags

from experiments import compare_policies as cp  # defines --config

KEYS = ("request_throughput", "output_throughput", "ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50", "tpot_ms_p99",
        "e2e_ms_p50", "e2e_ms_p99", "goodput", "num_completed", "request_preemptions")  # fmt: skip
FLAGS = flags.FLAGS


def _numbers(cfg, field: str) -> list[float]:
    values = (cfg.get("sweep") or {}).get(field)
    if isinstance(values, str):
        values = values.split(",")
    values = [v for v in values or () if not (isinstance(v, str) and not v.strip())]  # `--config.sweep.loads=`
    try:
        values = [float(v) for v in values or ()]
    except (TypeError, ValueError):
        raise ValueError(f"config.sweep.{field} must be numbers, got {values!r}") from None
    if values and min(values) <= 0:
        raise ValueError(f"config.sweep.{field} must be numbers > 0, got {values!r}")
    return values


def points_of(cfg) -> tuple[str, list[float]]:
    """("load", the loads of config.sweep.loads) or ("rate", the requests/s of config.sweep.rates): exactly one of
    the two must be set (a command line empties the other with `--config.sweep.loads=`)."""
    loads, rates = _numbers(cfg, "loads"), _numbers(cfg, "rates")
    if bool(loads) == bool(rates):
        raise ValueError(
            f"set one of config.sweep.loads (fractions of capacity) and config.sweep.rates (requests/s), got "
            f"loads={loads} rates={rates}"
        )
    return ("load", loads) if loads else ("rate", rates)


def rates_of(cfg) -> list[float]:
    """The sweep's absolute rates (config.sweep.rates); a ValueError when the sweep is over loads instead."""
    kind, values = points_of(cfg)
    if kind != "rate":
        raise ValueError("config.sweep.rates is empty: this sweep is over config.sweep.loads")
    return values


def sweep(cfg, kind: str, points: list[float]) -> tuple[list[dict], dict | None]:
    """One compare_policies run per point (on config.seeds workload seeds); a row per (point, policy, seed), and the
    capacity the loads are relative to (None for absolute rates). `cfg` is resolved (compare_policies.prepare_run)."""
    from cbjax.bench.metrics import summarize
    from cbjax.bench.workload import make_workload
    from experiments.load_harness import workload_config

    cfg = cfg.copy_and_resolve_references()
    if "load" in cfg.workload:
        cfg.workload.load = 0.0  # each point sets an absolute rate; a load the config inherits is not used
    capacity = None
    if kind == "load":  # measured on seed 0's requests, which every point's seed-0 runs get
        capacity = cp.measure_capacity(cfg, make_workload(workload_config(cfg, offline=True)), progress=False)
        print(capacity.header(1.0), flush=True)
    slo = {k: v for k, v in cfg.slo.to_dict().items() if v is not None}
    seeds = cfg.get("seeds", 1)
    rows = []
    for point in points:
        rate = capacity.rate_at(point) if capacity is not None else point
        cfg.workload.request_rate = rate
        comp = cp.run_comparison(cfg, progress=False)
        for policy, results in comp.repeats.items():
            for i, res in enumerate(results):
                s = summarize(res.requests, res.steps, slo=slo)
                row = {"load": point if capacity is not None else None, "rate": rate, "policy": policy, "run": i + 1}
                row.update(seed=cfg.workload.seed + i % seeds, **{k: s.get(k) for k in KEYS}, wall_s=res.wall_s)
                rows.append(row)
                label = f"load {point:g} ({rate:.3g}/s)" if capacity is not None else f"rate {rate:g}/s"
                print(f"{label} {policy:>10} #{i + 1}: " + "  ".join(f"{k}={s.get(k):.4g}" for k in KEYS[:7]),
                      flush=True)  # fmt: skip
    return rows, None if capacity is None else capacity.to_dict(1.0)


def medians(rows: list[dict]) -> list[dict]:
    """One row per (rate, policy): the median over its seeds of each metric (for the plot)."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["rate"], r["policy"]), []).append(r)
    out = []
    for (rate, policy), group in groups.items():
        values = {k: [r[k] for r in group if r.get(k) is not None] for k in KEYS}
        out.append({"rate": rate, "policy": policy, **{k: statistics.median(v) for k, v in values.items() if v}})
    return out


def main(argv):
    del argv
    from cbjax.bench import plots, results

    load_before = os.getloadavg()
    try:
        cfg = cp.load_config()
        kind, points = points_of(cfg)
        cfg, _ = cp.prepare_run(cfg)
    except ValueError as e:
        sys.exit(f"sim_sweep: {e}")
    folder = results.run_dir(cfg.output_dir, cfg.run_name, overwrite=cfg.get("overwrite", False))
    results.write_config(os.path.join(folder, "config.json"), cfg)
    rows, capacity = sweep(cfg, kind, points)
    results.write_json(os.path.join(folder, "sweep.json"), rows)
    with open(os.path.join(folder, "sweep.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    plots.plot_load_curves(os.path.join(folder, "load_curves.png"), medians(rows))
    if FLAGS.doc_data:
        from cbjax.bench.doc_data import write_doc_data

        write_doc_data(
            FLAGS.doc_data,
            command=f"python -m experiments.sim_sweep {' '.join(sys.argv[1:])}",
            runs=rows,
            what=f"latency against {kind} on the simulator: one run per ({kind}, policy, workload seed)",
            capacity=capacity,
            load_average_before=list(load_before),
            load_average_after=list(os.getloadavg()),
            config=cfg.to_dict(),
        )
        print(f"data for the docs: {FLAGS.doc_data}")
    print(f"results: {folder}")


if __name__ == "__main__":
    flags.DEFINE_string("doc_data", None, "also write every run to this data file for the docs (docs/data/NAME.json)")
    app.run(main, flags_parser=cp.parse_flags)
