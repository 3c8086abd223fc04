"""PNG plots of a policy comparison (matplotlib, Agg backend: no display needed).

  throughput.png    output tokens/s and requests/s per policy (bars)
  latency_cdf.png   CDFs of TTFT and TPOT per policy (completed requests, vLLM definitions)
  utilisation.png   slot occupancy and KV-cache utilisation per step over the run's time

Inputs are what the online loop returns (`{policy: OnlineResult}`) and the summaries (`{policy: summary dict}`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from cbjax.bench.metrics import request_latencies

__all__ = ["plot_all", "plot_latency_cdfs", "plot_load_curves", "plot_throughput", "plot_utilisation"]


def _pyplot():
    # Imported on first use and forced to Agg, so importing this module costs nothing and works headless.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _finite(x) -> float:
    return float(x) if x is not None and np.isfinite(x) else 0.0


def plot_throughput(path: str, summaries: Mapping[str, Mapping[str, Any]]) -> str:
    plt = _pyplot()
    policies = list(summaries)
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    for ax, key, label in (
        (axes[0], "output_throughput", "output tokens/s"),
        (axes[1], "request_throughput", "requests/s"),
    ):
        values = [_finite(summaries[p].get(key)) for p in policies]
        # With repeats, the 95% interval of each median (cbjax/bench/intervals.py) as an error bar.
        cis = [summaries[p].get(f"{key}_ci") for p in policies]
        errors = None
        if all(ci is not None and all(math.isfinite(b) for b in ci) for ci in cis):
            errors = [
                [max(0.0, v - lo) for v, (lo, _) in zip(values, cis)],
                [max(0.0, hi - v) for v, (_, hi) in zip(values, cis)],
            ]
        bars = ax.bar(policies, values, yerr=errors, capsize=4, color=[f"C{i}" for i in range(len(policies))])
        ax.bar_label(bars, fmt="%.1f")
        ax.set_ylabel(label)
        ax.set_title(label)
        ax.margins(y=0.15)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


LOAD_CURVES = (
    ("ttft_ms_p50", "TTFT p50 (ms)"),
    ("ttft_ms_p99", "TTFT p99 (ms)"),
    ("tpot_ms_p50", "TPOT p50 (ms)"),
    ("e2e_ms_p50", "E2E p50 (ms)"),
    ("output_throughput", "output tokens/s"),
)


def plot_load_curves(path: str, rows: Sequence[Mapping[str, Any]], curves=LOAD_CURVES) -> str:
    """Figures against the offered request rate, one line per policy, one panel per (summary key, title) of
    `curves` (latency and throughput by default; latencies on a log scale). `rows` hold "rate", "policy" and the
    keys."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(curves), figsize=(4 * len(curves), 3.4), squeeze=False)
    axes = axes[0]
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    for ax, (key, label) in zip(axes, curves):
        for i, policy in enumerate(policies):
            pts = sorted((r["rate"], r.get(key)) for r in rows if r["policy"] == policy)
            color = f"C{i}" if len(policies) <= 10 else plt.get_cmap("tab20")(i % 20)  # the zoo has 13
            ax.plot([x for x, _ in pts], [_finite(y) for _, y in pts], "o-", color=color, label=policy)
        ax.set_xlabel("offered load (requests/s)")
        ax.set_title(label)
        if "_ms_" in key:
            ax.set_yscale("log")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _cdf(ax, samples_ms, label):
    x = np.sort(np.asarray(samples_ms, dtype=float))
    if x.size:
        ax.step(x, np.arange(1, x.size + 1) / x.size, where="post", label=label)


def plot_latency_cdfs(path: str, results: Mapping[str, Any]) -> str:
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for policy, res in results.items():
        lat = request_latencies(res.requests)
        _cdf(axes[0], np.asarray(lat["ttft"]) * 1e3, policy)
        _cdf(axes[1], np.asarray(lat["tpot"]) * 1e3, policy)
    for ax, name in zip(axes, ("TTFT (ms, queueing included)", "TPOT (ms)")):
        ax.set_xlabel(name)
        ax.set_ylabel("fraction of requests")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_utilisation(path: str, results: Mapping[str, Any]) -> str:
    plt = _pyplot()
    fig, axes = plt.subplots(2, 1, figsize=(10, 5.5), sharex=True)
    for policy, res in results.items():
        steps = res.steps
        if not steps:
            continue
        t = [s.time for s in steps]
        axes[0].plot(
            t, [s.num_scheduled_seqs / s.max_num_seqs if s.max_num_seqs else 0 for s in steps], label=policy, lw=0.8
        )
        axes[1].plot(
            t, [s.kv_pages_used / s.kv_pages_total if s.kv_pages_total else 0 for s in steps], label=policy, lw=0.8
        )
    axes[0].set_ylabel("slot occupancy")
    axes[1].set_ylabel("KV pages used")
    axes[1].set_xlabel("time since the first arrival (s)")
    for ax in axes:
        ax.set_ylim(0, 1.05)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_all(folder: str, summaries: Mapping[str, Mapping[str, Any]], results: Mapping[str, Any]) -> list[str]:
    """Every plot of the comparison into `folder`; returns the paths written."""
    return [
        plot_throughput(os.path.join(folder, "throughput.png"), summaries),
        plot_latency_cdfs(os.path.join(folder, "latency_cdf.png"), results),
        plot_utilisation(os.path.join(folder, "utilisation.png"), results),
    ]
