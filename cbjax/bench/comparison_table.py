"""The policy comparison's printed tables: one row per policy (medians over repeats when there are several), the
intervals of those medians and their paired ratios to a baseline, and the one-line checks under them. Pure Python:
it reads the summaries (cbjax.bench.metrics.summarize, cbjax.bench.intervals.summarize_repeats), nothing else."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from cbjax.bench.intervals import Interval, format_interval

# (header, summary key, format): the table's columns. Latencies in ms; rates per second.
COLUMNS = (
    ("req/s", "request_throughput", "{:.2f}"),
    ("out tok/s", "output_throughput", "{:.1f}"),
    ("TTFT p50", "ttft_ms_p50", "{:.0f}"),
    ("TTFT p99", "ttft_ms_p99", "{:.0f}"),
    ("TPOT p50", "tpot_ms_p50", "{:.1f}"),
    ("TPOT p99", "tpot_ms_p99", "{:.1f}"),
    ("E2E p99", "e2e_ms_p99", "{:.0f}"),
    ("goodput", "goodput", "{:.2f}"),
    ("slots", "slot_occupancy_mean", "{:.0%}"),
    ("preempt", "request_preemptions", "{:d}"),
    ("recomp tok", "recomputed_tokens", "{:d}"),
    ("swap MB", "swap_mb", "{:.1f}"),
    ("hit rate", "prefix_cache_hit_rate", "{:.0%}"),
    ("long done", "long_completion_rate", "{:.0%}"),
    ("same out", "same_outputs", "{:.0%}"),
    ("accept", "spec_acceptance_rate", "{:.0%}"),
    ("acc len", "spec_mean_acceptance_length", "{:.2f}"),
)

# The metrics a comparison with repeats reports as medians with intervals (and ratios to a baseline).
INTERVAL_METRICS = (
    "request_throughput",
    "output_throughput",
    "ttft_ms_p50",
    "ttft_ms_p99",
    "tpot_ms_p50",
    "tpot_ms_p99",
    "e2e_ms_p50",
    "e2e_ms_p99",
    "goodput",
)


def _cell(value, fmt: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return fmt.format(int(value) if fmt == "{:d}" else value)


def _aligned(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """The header and rows as lines of aligned columns: the first left-aligned, the others right-aligned."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return [
        "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
        for r in [header, *rows]
    ]


def format_table(summaries: Mapping[str, Mapping[str, Any]]) -> str:
    """One row per policy, the COLUMNS above, aligned."""
    header = ["policy", *(h for h, _, _ in COLUMNS)]
    rows = [[name, *(_cell(s.get(key), fmt) for _, key, fmt in COLUMNS)] for name, s in summaries.items()]
    lines = _aligned(header, rows)
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


# The columns of the interval table: (header, metric, format of its values).
INTERVAL_COLUMNS = (
    ("out tok/s", "output_throughput", "{:.0f}"),
    ("TTFT p50", "ttft_ms_p50", "{:.0f}"),
    ("TTFT p99", "ttft_ms_p99", "{:.0f}"),
    ("TPOT p50", "tpot_ms_p50", "{:.1f}"),
    ("E2E p50", "e2e_ms_p50", "{:.0f}"),
)


def interval_table(summaries: Mapping[str, Mapping[str, Any]], baseline: str | None = None) -> str | None:
    """With repeats: per policy and metric, the median and its 95% interval, and (given a baseline) the paired ratio
    to the baseline, starred where its interval excludes 1 (a difference larger than the repeats' noise)."""
    n = min((s.get("repeats", 1) for s in summaries.values()), default=1)
    if n < 2:
        return None

    def cell(name, s, key, fmt):
        low, high = s[f"{key}_ci"]
        text = format_interval(Interval(s[key], low, high, n), fmt)
        if baseline is not None and name != baseline and f"{key}_ratio" in s:
            star = "*" if s[f"{key}_significant"] else ""
            text += f" {_cell(s[f'{key}_ratio'], '{:.2f}')}x{star}"
        return text

    header = ["policy", *(h for h, _, _ in INTERVAL_COLUMNS)]
    rows = [[name, *(cell(name, s, key, fmt) for _, key, fmt in INTERVAL_COLUMNS)] for name, s in summaries.items()]
    lines = _aligned(header, rows)
    ratio = "" if baseline is None else f"; x: paired ratio to {baseline}, * where its 95% interval excludes 1"
    return "\n".join([f"medians over {n} repeats with 95% intervals [low, high]{ratio}", *lines])


def outputs_line(summaries: Mapping[str, Mapping[str, Any]]) -> str | None:
    """Whether every entry generated exactly the first entry's tokens (greedy: they must)."""
    if len(summaries) < 2:
        return None
    first = next(iter(summaries))
    differ = [n for n, s in summaries.items() if s.get("same_outputs", math.nan) != 1.0]
    if not differ:
        return f"outputs: every entry generated exactly {first}'s tokens"
    return f"outputs: differ from {first}'s (or none compared) in {differ}"


def ratio_line(summaries: Mapping[str, Mapping[str, Any]]) -> str | None:
    if "fcfs" not in summaries or "static" not in summaries:
        return None
    """The gap continuous batching exists to show: fcfs's output throughput over static's, and how many times lower
    its median TTFT is (None where either run has no TTFT)."""
    r = summaries["fcfs"]["output_throughput_vs_static"]
    line = f"continuous (fcfs) / static output throughput: {r:.2f}x"
    ttft_fcfs, ttft_static = summaries["fcfs"].get("ttft_ms_p50"), summaries["static"].get("ttft_ms_p50")
    if ttft_fcfs is not None and ttft_static is not None and ttft_fcfs > 0 and math.isfinite(ttft_static):
        line += f"; TTFT p50 {ttft_static / ttft_fcfs:.1f}x lower ({ttft_fcfs:.0f} vs {ttft_static:.0f} ms)"
    return line
