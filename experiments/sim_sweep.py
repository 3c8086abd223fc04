"""Latency against load: the compare_policies run repeated at each arrival rate of `config.sweep.rates`, meant for
the simulator (seconds per point). Writes results/<run_name>/: config.json, sweep.csv, sweep.json (one row per
rate and policy: the summary's metrics) and load_curves.png (TTFT, TPOT, E2E and throughput against the rate).

  python -m experiments.sim_sweep --config=configs/sim_sweep.py [--config.sweep.rates=10,20,40]

Any config of experiments/compare_policies works, given a `sweep.rates` entry; on the real engine each point takes
as long as a compare_policies run.
"""

import csv
import os
import sys

from absl import app

from experiments import compare_policies as cp  # defines --config

KEYS = ("request_throughput", "output_throughput", "ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50", "tpot_ms_p99",
        "e2e_ms_p50", "e2e_ms_p99", "goodput", "num_completed", "request_preemptions")  # fmt: skip


def rates_of(cfg) -> list[float]:
    sweep = cfg.get("sweep") or {}
    rates = sweep.get("rates")
    if isinstance(rates, str):
        rates = rates.split(",")
    try:
        rates = [float(r) for r in rates or ()]
    except (TypeError, ValueError):
        raise ValueError(f"config.sweep.rates must be numbers, got {rates!r}") from None
    if not rates or min(rates) <= 0:
        raise ValueError(f"config.sweep.rates must be a non-empty list of rates > 0, got {rates!r}")
    return rates


def sweep(cfg, rates: list[float]) -> list[dict]:
    """One compare_policies run per rate; a row per (rate, policy)."""
    from cbjax.bench.workload import make_workload

    rows = []
    if "load" in cfg.workload:
        cfg.workload.load = 0.0  # the sweep's rates are absolute: a load the config inherits is not used
    for rate in rates:
        cfg.workload.request_rate = rate
        comp = cp.run_comparison(cfg, workload=make_workload(cp.workload_config(cfg)), progress=False)
        for policy, s in cp.summaries_of(cfg, comp).items():
            rows.append({"rate": rate, "policy": policy, **{k: s.get(k) for k in KEYS}, "wall_s": s["wall_s"]})
            print(f"rate {rate:g}/s {policy:>10}: " + "  ".join(f"{k}={s.get(k):.4g}" for k in KEYS[:7]), flush=True)
    return rows


def main(argv):
    del argv
    from cbjax.bench import plots, results

    try:
        cfg = cp.load_config()
        rates = rates_of(cfg)
        cfg, _ = cp.prepare_run(cfg)
    except ValueError as e:
        sys.exit(f"sim_sweep: {e}")
    folder = results.run_dir(cfg.output_dir, cfg.run_name, overwrite=cfg.get("overwrite", False))
    results.write_config(os.path.join(folder, "config.json"), cfg)
    rows = sweep(cfg, rates)
    results.write_json(os.path.join(folder, "sweep.json"), rows)
    with open(os.path.join(folder, "sweep.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    plots.plot_load_curves(os.path.join(folder, "load_curves.png"), rows)
    print(f"results: {folder}")


if __name__ == "__main__":
    app.run(main, flags_parser=cp.parse_flags)
