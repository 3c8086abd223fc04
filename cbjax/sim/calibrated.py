"""CalibratedCost: a step's time as a linear model of its features, fitted to steps measured on the real engine.

    time = intercept[bucket] + sum_k coef[k] * feature[k]

The intercept per token bucket is the cost of the padded step itself (the dense layers run on every padded token, so
a bucket's cost is nearly fixed); the shared coefficients add what varies within a bucket: per real token, per
sequence (slots, sampling), attention (per context token read and per (query, key) pair computed), and per byte of
KV swapped. (Pages copied on write within the device, StepFeatures.copy_bytes, are not fitted: a page copy is a few
microseconds of HBM traffic, below what a calibration resolves.) Bucket 0 is a swap-only step. Fitted by least
squares over all steps at once (columns scaled to unit maximum), with the shared coefficients kept >= 0 (a feature
whose coefficient would be negative is dropped and the rest refitted); then steps far off that fit (the machine's
hiccups) are left out and the rest fitted again. A bucket never seen in calibration gets an intercept linearly
interpolated (or extrapolated) in the bucket size from the seen ones.

The intercepts are partially pooled: intercept[b] = a + c * b + d[b], a line in the bucket size (the padded dense
work) plus a per-bucket deviation d[b] shrunk toward 0 as if each bucket had SHRINK_STEPS more steps on the line
(ridge on d). A bucket seen in thousands of steps keeps its own intercept; one seen in a handful gets about the
line's. With free intercepts, a calibration sweep that put 1-7 steps in its middle buckets fitted them 2-3x off
the line (94 ms for bucket 96 between 28 and 30 ms), and a workload living in those buckets was mispredicted by
35-50% (docs/sim.md, fidelity).

What it does not model: compiles (the engine compiles before the run), the host's Python time outside the step
(the online loop between steps), and contention from other processes (calibrate and run on the same, idle machine).
"""

import operator
from collections.abc import Sequence

import numpy as np

from cbjax.sim.features import StepFeatures

SHARED_FEATURES = ("num_tokens", "num_seqs", "sum_context", "attention_pairs", "swap_bytes")
SHRINK_STEPS = 30.0  # pseudo-steps pulling each bucket's intercept toward the line over bucket sizes
TRIM_SIGMAS = 3.5  # a step this many robust standard deviations off the first fit is left out of the second


class CalibratedCost:
    kind = "calibrated"

    def __init__(self, intercepts: dict[int, float], coefficients: dict[str, float], fit_stats: dict | None = None):
        unknown = set(coefficients) - set(SHARED_FEATURES)
        if unknown:
            raise ValueError(f"unknown features {sorted(unknown)}; known: {list(SHARED_FEATURES)}")
        if not intercepts:
            raise ValueError("CalibratedCost needs at least one bucket's intercept")
        self.intercepts = {int(b): float(v) for b, v in intercepts.items()}
        self.coefficients = {k: float(coefficients.get(k, 0.0)) for k in SHARED_FEATURES}
        self.fit_stats = dict(fit_stats or {})
        self._buckets = np.array(sorted(b for b in self.intercepts if b > 0), dtype=np.float64)
        self._values = np.array([self.intercepts[int(b)] for b in self._buckets])
        self._cache: dict[int, float] = {}
        # step_time reads the shared features in C, once per step: the same products, summed in the same order.
        self._shared = operator.attrgetter(*SHARED_FEATURES)
        self._coefs = tuple(self.coefficients[k] for k in SHARED_FEATURES)

    def intercept(self, bucket: int) -> float:
        """The bucket's fitted intercept, or one interpolated from the fitted buckets."""
        if bucket in self.intercepts:
            return self.intercepts[bucket]
        if bucket not in self._cache:
            x, y = self._buckets, self._values
            if bucket == 0 or len(x) == 0:
                v = min(self.intercepts.values())
            elif len(x) == 1:
                v = float(y[0] * bucket / x[0])
            elif bucket < x[0]:
                v = float(y[0] + (bucket - x[0]) * (y[1] - y[0]) / (x[1] - x[0]))
            elif bucket > x[-1]:
                v = float(y[-1] + (bucket - x[-1]) * (y[-1] - y[-2]) / (x[-1] - x[-2]))
            else:
                v = float(np.interp(bucket, x, y))
            self._cache[bucket] = max(v, 0.0)
        return self._cache[bucket]

    def step_time(self, f: StepFeatures) -> float:
        t = self.intercept(f.padded_tokens) + sum(map(operator.mul, self._coefs, self._shared(f)))
        return max(t, 1e-7)  # time always moves forward

    @classmethod
    def fit(cls, features: Sequence[StepFeatures], times: Sequence[float]) -> "CalibratedCost":
        """Least squares over measured steps: `times[i]` (seconds) is what step `features[i]` took. Robust to the
        machine's hiccups: after a first fit, steps whose time is more than TRIM_SIGMAS robust standard deviations
        off it (in log ratio; the sigma from the median absolute deviation) are left out and the rest refitted."""
        if len(features) != len(times) or not features:
            raise ValueError(f"fit needs as many times as steps (and some), got {len(features)} and {len(times)}")
        y = np.asarray(times, dtype=np.float64)
        buckets = sorted({f.padded_tokens for f in features})
        col = {b: 2 + i for i, b in enumerate(buckets)}  # columns: a, c, d[b] per bucket, the shared features
        shared = 2 + len(buckets)
        X = np.zeros((len(features), shared + len(SHARED_FEATURES)))
        X[:, 0] = 1.0
        for i, f in enumerate(features):
            X[i, 1] = f.padded_tokens
            X[i, col[f.padded_tokens]] = 1.0
            X[i, shared:] = [getattr(f, k) for k in SHARED_FEATURES]
        w = _solve(X, y, shared, len(buckets))
        # A step far off the fit is the machine (another job, a page fault), not the step: a single 3x step moved
        # the shared coefficients by tens of percent in a few-thousand-step calibration.
        r = np.log(np.maximum(y, 1e-9) / np.maximum(X @ w, 1e-9))
        sigma = 1.4826 * np.median(np.abs(r - np.median(r)))
        kept = np.abs(r - np.median(r)) <= TRIM_SIGMAS * max(sigma, 1e-6)
        if not kept.all():
            w = _solve(X[kept], y[kept], shared, len(buckets))
        pred = X @ w
        rel = np.abs(pred - y) / np.maximum(y, 1e-9)
        stats = dict(
            num_steps=len(y),
            trimmed_steps=int((~kept).sum()),
            rmse_s=float(np.sqrt(np.mean((pred - y) ** 2))),
            mean_abs_rel_error=float(rel.mean()),
            total_rel_error=float((pred.sum() - y.sum()) / y.sum()),
            steps_per_bucket={str(b): int(sum(f.padded_tokens == b for f in features)) for b in buckets},
        )
        return cls(
            {b: float(w[0] + w[1] * b + w[col[b]]) for b in buckets},
            {k: float(w[shared + j]) for j, k in enumerate(SHARED_FEATURES)},
            stats,
        )

    def to_dict(self) -> dict:
        return {
            "kind": self.kind,
            "intercepts_s": {str(b): v for b, v in sorted(self.intercepts.items())},
            "coefficients_s": self.coefficients,
            "fit": self.fit_stats,
        }

    @classmethod
    def from_dict(cls, d: dict) -> "CalibratedCost":
        return cls({int(b): v for b, v in d["intercepts_s"].items()}, d["coefficients_s"], d.get("fit"))


def _solve(X: np.ndarray, y: np.ndarray, shared: int, num_buckets: int) -> np.ndarray:
    """Weights of the linear model (columns: a, c, d[b] per bucket, the shared features), with the ridge that pools
    the intercepts and the shared coefficients kept >= 0."""
    scale = np.abs(X).max(axis=0)
    scale[scale == 0] = 1.0  # a feature that never varies (no swaps measured) gets coefficient 0
    # The ridge on the deviations: a row per bucket, sqrt(SHRINK_STEPS) * d[b] = 0 (d's columns are 0/1, unscaled).
    penalty = np.zeros((num_buckets, X.shape[1]))
    penalty[np.arange(num_buckets), 2 + np.arange(num_buckets)] = np.sqrt(SHRINK_STEPS)
    A = np.vstack([X / scale, penalty])
    b_all = np.concatenate([y, np.zeros(num_buckets)])
    # A marginal cost cannot be negative: a shared feature whose coefficient comes out below zero (noise, or
    # collinearity with another feature) is dropped and the rest refitted (intercepts stay free).
    keep = np.ones(X.shape[1], bool)
    while True:
        w = np.zeros(X.shape[1])
        w[keep], *_ = np.linalg.lstsq(A[:, keep], b_all, rcond=None)
        negative = [j for j in range(shared, X.shape[1]) if keep[j] and w[j] < 0]
        if not negative:
            return w / scale
        keep[min(negative, key=lambda j: w[j])] = False
