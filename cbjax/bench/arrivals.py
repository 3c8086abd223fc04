"""Arrival processes: when each request of a workload reaches the engine."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from cbjax.bench.fields import as_choice, as_float, as_int

ARRIVALS = ("offline", "poisson", "gamma", "trace")


def arrival_times(
    n: int,
    process: str = "offline",
    *,
    rng: np.random.Generator | None = None,
    request_rate: float | None = None,
    burstiness: float = 1.0,
    trace: Sequence[float] | None = None,
) -> np.ndarray:
    """`n` non-decreasing arrival times in seconds, the first at 0 (except for a trace, see below).

    offline: all at 0.
    poisson: exponential gaps with mean 1/request_rate.
    gamma:   gamma gaps with shape = burstiness and scale = 1/(request_rate * burstiness), as `vllm bench serve`:
             the mean gap stays 1/request_rate and the coefficient of variation is 1/sqrt(burstiness).
             burstiness=1 is exactly the poisson process (same draws, same times).
    trace:   the first `n` times of `trace`, shifted so the earliest is 0 and sorted.
    A request_rate of inf means offline, as in vLLM.
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
    if math.isinf(rate):
        return np.zeros(n)
    if rng is None:
        raise ValueError("a numpy Generator (rng) is required for random arrivals")
    gaps = rng.gamma(shape, 1.0 / (rate * shape), size=max(n - 1, 0))
    return np.concatenate([[0.0], np.cumsum(gaps)])[:n]
