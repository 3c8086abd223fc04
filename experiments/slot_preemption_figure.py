"""The figure of docs/policies.md's "Preemption for a slot", drawn from its data file (configs/slot_preemption.py).

  python -m experiments.slot_preemption_figure docs/data/slot_preemption_2026-12-04_load0.7.json \
      docs/data/slot_preemption_2026-12-04.json --out=docs/figures/slot_preemption_2026-12-04.png
  # without --out: docs/figures/<the first data file's name>.png

One row per data file (a load), two panels, the important class (chat, the summaries' `short_*`) and the rest (rag
and code, `long_*`): TTFT p50 and p99 for each entry (preempt_for_slot off and on), each bar the median over the data
file's runs with its 95% bootstrap interval (cbjax/bench/intervals.py), on a log scale. The numbers themselves are
in the generated tables beside it.
"""

from __future__ import annotations

import argparse
import json
import math
import os

from cbjax.bench.intervals import median_interval

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PANELS = (("short", "chat (priority 0)"), ("long", "rag + code (priority 1)"))
PERCENTILES = ("p50", "p99")


def intervals(data: dict) -> dict[tuple[str, str, str], tuple[float, float, float]]:
    """(entry, class, percentile) -> (median, low, high) of TTFT in ms over the runs of that entry."""
    entries = list(dict.fromkeys(r["policy"] for r in data["runs"]))
    out = {}
    for entry in entries:
        runs = [r for r in data["runs"] if r["policy"] == entry]
        for cls, _ in PANELS:
            for p in PERCENTILES:
                values = [float(r[f"{cls}_ttft_ms_{p}"]) for r in runs if r.get(f"{cls}_ttft_ms_{p}") is not None]
                iv = median_interval(values)
                out[entry, cls, p] = (iv.median, iv.low, iv.high)
    return out


def plot(datas: list[dict], path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, grid = plt.subplots(len(datas), len(PANELS), figsize=(9, 3.2 * len(datas)), squeeze=False)
    for data, axes in zip(datas, grid):
        _plot_row(data, axes)
    fig.suptitle("priority, 8 slots, pages to spare (simulator): median of the runs [95% interval]", fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _plot_row(data: dict, axes) -> None:
    ivs = intervals(data)
    entries = list(dict.fromkeys(r["policy"] for r in data["runs"]))
    n_runs = len(data["runs"]) // max(1, len(entries))
    load = (data.get("load") or {}).get("load")
    width = 0.8 / len(entries)
    for ax, (cls, title) in zip(axes, PANELS):
        for k, entry in enumerate(entries):
            xs = [i + (k - (len(entries) - 1) / 2) * width for i in range(len(PERCENTILES))]
            med = [ivs[entry, cls, p][0] for p in PERCENTILES]
            err = [[m - ivs[entry, cls, p][1] for m, p in zip(med, PERCENTILES)],
                   [ivs[entry, cls, p][2] - m for m, p in zip(med, PERCENTILES)]]  # fmt: skip
            err = [[0.0 if math.isnan(e) else e for e in row] for row in err]
            ax.bar(xs, med, width, yerr=err, capsize=3, label=f"preempt_for_slot {entry}")
        ax.set_xticks(range(len(PERCENTILES)), [f"TTFT {p}" for p in PERCENTILES])
        ax.set_yscale("log")
        ax.set_ylabel("ms")
        ax.set_title(f"{title}, load {load}, {n_runs} runs" if load is not None else f"{title}, {n_runs} runs")
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("data", nargs="+", help="data files of configs/slot_preemption.py, one row each")
    parser.add_argument("--out", help="the PNG (default: docs/figures/<the first data file's name>.png)")
    args = parser.parse_args(argv)
    datas = []
    for path in args.data:
        with open(path) as f:
            datas.append(json.load(f))
    name = os.path.splitext(os.path.basename(args.data[0]))[0]
    print(plot(datas, args.out or os.path.join(ROOT, "docs", "figures", f"{name}.png")))


if __name__ == "__main__":
    main()
