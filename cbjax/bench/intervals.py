"""Confidence intervals over repeated runs, and whether two policies differ by more than the noise.

A comparison on a shared machine moves 5-50% between runs, so one run per policy can rank them either way. The
harness runs each policy several times, interleaving policies within each repeat so that a slow minute hits all of
them, and reports per metric:
- the median over repeats with a percentile-bootstrap interval of that median (`median_interval`);
- against a baseline policy, the median of the per-repeat ratios policy / baseline with its bootstrap interval
  (`paired_ratio_interval`): repeat i of both ran in the same minute, so their ratio cancels the drift they share;
- `significant`: the ratio's interval excludes 1. A policy compared with itself has every ratio equal to 1 and is
  never significant.

The percentile bootstrap of a median is coarse with few repeats (with n repeats its bounds are order statistics of
the sample), which is the honest answer: 3 repeats cannot resolve a 5% difference, and the interval says so. With
fewer than 2 repeats there is no spread to estimate: the bounds are NaN and nothing is significant. Resampling is
seeded, so a table is reproducible from its raw records.
"""

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

CONFIDENCE = 0.95
RESAMPLES = 4000


@dataclasses.dataclass(frozen=True)
class Interval:
    """A median and its confidence interval [low, high] from `n` values (NaN bounds when n < 2)."""

    median: float
    low: float
    high: float
    n: int

    @property
    def known(self) -> bool:
        """Whether the bounds were estimated (at least 2 finite values)."""
        return not (math.isnan(self.low) or math.isnan(self.high))

    def excludes(self, value: float) -> bool:
        """Whether `value` lies outside the interval (False when the bounds are unknown)."""
        return self.known and (value < self.low or value > self.high)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _finite(values: Sequence[float]) -> np.ndarray:
    a = np.asarray([float(v) for v in values], dtype=np.float64)
    return a[np.isfinite(a)]


def median_interval(
    values: Sequence[float], confidence: float = CONFIDENCE, resamples: int = RESAMPLES, seed: int = 0
) -> Interval:
    """The median of the finite `values` and the percentile-bootstrap interval of the median at `confidence`."""
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence!r}")
    if resamples < 1:
        raise ValueError(f"resamples must be >= 1, got {resamples!r}")
    a = _finite(values)
    n = len(a)
    if n == 0:
        return Interval(math.nan, math.nan, math.nan, 0)
    median = float(np.median(a))
    if n < 2:
        return Interval(median, math.nan, math.nan, n)
    rng = np.random.default_rng(seed)
    medians = np.median(a[rng.integers(0, n, size=(resamples, n))], axis=1)
    alpha = 1.0 - confidence
    low, high = np.quantile(medians, [alpha / 2, 1 - alpha / 2], method="inverted_cdf")
    return Interval(median, float(low), float(high), n)


def paired_ratio_interval(
    values: Sequence[float],
    baseline: Sequence[float],
    confidence: float = CONFIDENCE,
    resamples: int = RESAMPLES,
    seed: int = 0,
) -> Interval:
    """The median of the per-repeat ratios values[i] / baseline[i] and its bootstrap interval. Repeat i of both must
    have run in the same sitting (interleaved); pairs with a non-finite value or a zero baseline are left out."""
    if len(values) != len(baseline):
        raise ValueError(f"paired values need equal lengths, got {len(values)} and {len(baseline)}")
    ratios = [v / b for v, b in zip(values, baseline) if math.isfinite(v) and math.isfinite(b) and b != 0]
    return median_interval(ratios, confidence, resamples, seed)


def significant(ratio: Interval, tolerance: float = 1e-9) -> bool:
    """Whether a paired ratio to the baseline differs from 1 by more than its interval allows. Within `tolerance`
    of 1 is 1: deterministic runs (a virtual clock with fixed step costs, the simulator) give equal metrics whose
    ratio may round to 1 +- 1e-16."""
    return ratio.known and (ratio.low > 1.0 + tolerance or ratio.high < 1.0 - tolerance)


def format_interval(interval: Interval, fmt: str = "{:.3g}") -> str:
    """'median [low, high]', or the median alone when the bounds are unknown."""
    if math.isnan(interval.median):
        return "-"
    if not interval.known:
        return fmt.format(interval.median)
    return f"{fmt.format(interval.median)} [{fmt.format(interval.low)}, {fmt.format(interval.high)}]"


def summarize_repeats(runs: Sequence[dict], keys: Sequence[str], baseline_runs: Sequence[dict] | None = None) -> dict:
    """One policy's summary over its repeats (`runs`: one summary dict per repeat, in repeat order). Starts from the
    first repeat's summary; for each metric of `keys` sets the median over repeats, `<key>_ci` ([low, high]) and
    `<key>_runs` (every repeat's value); with `baseline_runs` (the baseline policy's summaries of the same repeats)
    also `<key>_ratio`, `<key>_ratio_ci` and `<key>_significant` (the paired ratio's interval excludes 1)."""
    out = dict(runs[0])
    out["repeats"] = len(runs)
    for key in keys:
        values = [float(r.get(key, math.nan)) for r in runs]
        iv = median_interval(values)
        out[key], out[f"{key}_ci"], out[f"{key}_runs"] = iv.median, [iv.low, iv.high], values
        if baseline_runs is not None:
            base = [float(r.get(key, math.nan)) for r in baseline_runs]
            n = min(len(values), len(base))  # (an interrupted comparison may have fewer repeats of one)
            ratio = paired_ratio_interval(values[:n], base[:n])
            out[f"{key}_ratio"], out[f"{key}_ratio_ci"] = ratio.median, [ratio.low, ratio.high]
            out[f"{key}_significant"] = significant(ratio)
    return out
