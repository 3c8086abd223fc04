"""Arrival processes: when each request of a workload reaches the engine."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from cbjax.bench.fields import as_choice, as_float, as_int

ARRIVALS = ("offline", "poisson", "gamma", "weibull", "trace")
RANDOM_ARRIVALS = ("poisson", "gamma", "weibull")  # a rate, gaps drawn at random (a diurnal cycle may modulate them)


def arrival_times(
    n: int,
    process: str = "offline",
    *,
    rng: np.random.Generator | None = None,
    request_rate: float | None = None,
    burstiness: float = 1.0,
    trace: Sequence[float] | None = None,
    diurnal_period_s: float | None = None,
    diurnal_amplitude: float = 0.0,
) -> np.ndarray:
    """`n` non-decreasing arrival times in seconds, the first at 0 (except for a trace, see below).

    offline: all at 0.
    poisson: exponential gaps with mean 1/request_rate.
    gamma:   gamma gaps with shape = burstiness and scale = 1/(request_rate * burstiness), as `vllm bench serve`:
             the mean gap stays 1/request_rate and the coefficient of variation is 1/sqrt(burstiness).
             burstiness=1 is exactly the poisson process (same draws, same times).
    weibull: Weibull gaps with shape k = burstiness and the mean gap 1/request_rate; k < 1 gives a heavy tail of
             long pauses between bursts of short gaps (the shape fitted to production LLM traffic, e.g. BurstGPT),
             k = 1 is exponential, k > 1 more regular.
    trace:   the first `n` times of `trace`, shifted so the earliest is 0 and sorted.
    A request_rate of inf means offline, as in vLLM.

    With diurnal_period_s (poisson, gamma, weibull): the rate follows a daily-like cycle,
    request_rate * (1 + diurnal_amplitude * sin(2 pi t / diurnal_period_s)), amplitude in [0, 1): the process is
    drawn at the mean rate and its clock warped (`diurnal_warp`), so the mean rate over whole periods stays
    request_rate and the gaps keep their shape relative to the current rate.
    """
    n = as_int(n, "num_requests", minimum=0)
    process = as_choice(process, "arrival", ARRIVALS)
    if process == "trace":
        if trace is None:
            raise ValueError("arrival='trace' needs a trace of arrival times")
        if len(trace) < n:
            raise ValueError(f"arrival trace has {len(trace)} times, fewer than num_requests={n}")
        t = np.asarray(trace[:n], dtype=np.float64)
        if not np.all(np.isfinite(t)):
            raise ValueError("arrival trace holds a non-finite time")
        return np.sort(t - t.min()) if n else t
    if process == "offline":
        return np.zeros(n)
    if request_rate is None:
        raise ValueError(f"request_rate is required for arrival={process!r}")
    rate = as_float(request_rate, "request_rate", positive=True, allow_inf=True)
    shape = 1.0 if process == "poisson" else as_float(burstiness, "burstiness", positive=True)
    period, amplitude = check_diurnal(diurnal_period_s, diurnal_amplitude)
    if math.isinf(rate):
        return np.zeros(n)
    if rng is None:
        raise ValueError("a numpy Generator (rng) is required for random arrivals")
    if process == "weibull":
        gaps = rng.weibull(shape, size=max(n - 1, 0)) / (rate * math.gamma(1.0 + 1.0 / shape))
    else:
        gaps = rng.gamma(shape, 1.0 / (rate * shape), size=max(n - 1, 0))
    times = np.concatenate([[0.0], np.cumsum(gaps)])[:n]
    return times if period is None else diurnal_warp(times, period, amplitude)


def check_diurnal(period_s, amplitude) -> tuple[float | None, float]:
    """(period, amplitude) of a diurnal cycle, checked: period None (no cycle) or > 0, amplitude in [0, 1)."""
    amplitude = as_float(amplitude if amplitude is not None else 0.0, "diurnal_amplitude")
    if not 0.0 <= amplitude < 1.0:
        raise ValueError(f"diurnal_amplitude must be in [0, 1) (the rate stays > 0), got {amplitude}")
    if period_s is None:
        if amplitude:
            raise ValueError("diurnal_amplitude needs diurnal_period_s")
        return None, 0.0
    return as_float(period_s, "diurnal_period_s", positive=True), amplitude


def diurnal_warp(times: np.ndarray, period_s: float, amplitude: float) -> np.ndarray:
    """Times of a process at a constant rate R, moved to where a process of rate R (1 + a sin(2 pi t / P)) has the
    same count: the t with g(t) = t + a P / (2 pi) (1 - cos(2 pi t / P)) = s (the cumulative rate over R). g
    increases (a < 1) and g(t) - t lies in [0, a P / pi], so t lies in [s - a P / pi, s]: bisection, 60 halvings."""
    times = np.asarray(times, dtype=np.float64)
    if times.size == 0 or amplitude == 0.0:
        return times
    k = amplitude * period_s / (2 * math.pi)
    lo, hi = np.maximum(times - 2 * k, 0.0), times.copy()
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        below = mid + k * (1.0 - np.cos(2 * math.pi * mid / period_s)) < times
        lo, hi = np.where(below, mid, lo), np.where(below, hi, mid)
    return 0.5 * (lo + hi)


def at_mean_rate(times: np.ndarray, rate: float) -> np.ndarray:
    """A trace's times compressed or stretched (one factor) so that its mean rate, (n - 1) / span, is `rate`:
    the same bursts, at another load. A trace of fewer than two distinct times is returned as it is."""
    rate = as_float(rate, "trace_rate", positive=True)
    times = np.asarray(times, dtype=np.float64)
    span = float(times.max() - times.min()) if times.size else 0.0
    if times.size < 2 or span <= 0.0:
        return times
    return (times - times.min()) * ((times.size - 1) / span / rate)
