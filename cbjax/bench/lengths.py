"""Length distributions of generated workloads (prompt and output token counts)."""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any

import numpy as np

from cbjax.bench.fields import as_choice, as_float, as_int, check_fields, get_field


@dataclasses.dataclass(frozen=True)
class LengthSpec:
    """A distribution of token counts.

    dist="fixed":     every length is `value`.
    dist="uniform":   integers uniform in [low, high], both inclusive.
    dist="lognormal": exp(N(mu, sigma)) rounded to the nearest integer, then clipped to [min, max];
                      mu = ln(median), or mu = ln(mean) - sigma**2 / 2 when `mean` is given instead
                      (the mean of the unclipped distribution). `min` defaults to 1, `max` to no limit.
    Every length is at least 1.
    """

    dist: str = "fixed"
    value: int | None = None
    low: int | None = None
    high: int | None = None
    median: float | None = None
    mean: float | None = None
    sigma: float | None = None
    min: int | None = None
    max: int | None = None
    field: str = dataclasses.field(default="length", compare=False)  # name used in error messages

    _FIELDS = ("dist", "value", "low", "high", "median", "mean", "sigma", "min", "max")

    def __post_init__(self) -> None:
        f = self.field
        as_choice(self.dist, f"{f}.dist", ("fixed", "uniform", "lognormal"))
        if self.dist == "fixed":
            if self.value is None:
                raise ValueError(f"{f}.value is required for dist='fixed'")
            as_int(self.value, f"{f}.value", minimum=1)
        elif self.dist == "uniform":
            for name in ("low", "high"):
                if getattr(self, name) is None:
                    raise ValueError(f"{f}.{name} is required for dist='uniform'")
            low = as_int(self.low, f"{f}.low", minimum=1)
            high = as_int(self.high, f"{f}.high", minimum=1)
            if high < low:
                raise ValueError(f"{f}.high must be >= {f}.low, got low={low}, high={high}")
        else:
            if (self.median is None) == (self.mean is None):
                raise ValueError(f"{f}: dist='lognormal' needs exactly one of {f}.median and {f}.mean")
            center = "median" if self.median is not None else "mean"
            as_float(getattr(self, center), f"{f}.{center}", positive=True)
            if self.sigma is None:
                raise ValueError(f"{f}.sigma is required for dist='lognormal'")
            if as_float(self.sigma, f"{f}.sigma") < 0:
                raise ValueError(f"{f}.sigma must be >= 0, got {self.sigma!r}")
            lo = as_int(self.min, f"{f}.min", minimum=1) if self.min is not None else 1
            if self.max is not None and as_int(self.max, f"{f}.max", minimum=1) < lo:
                raise ValueError(f"{f}.max must be >= {f}.min, got min={lo}, max={self.max}")

    @classmethod
    def from_config(cls, spec: Any, field: str) -> LengthSpec:
        """A spec from a mapping/object with the fields above, or a bare int (== fixed)."""
        if isinstance(spec, LengthSpec):
            return dataclasses.replace(spec, field=field)
        if isinstance(spec, numbers.Real) and not isinstance(spec, bool):
            return cls(dist="fixed", value=as_int(spec, field, minimum=1), field=field)
        if spec is None or isinstance(spec, (str, bytes)):
            raise ValueError(f"{field} must be a length spec (a mapping with 'dist', ...) or an int, got {spec!r}")
        check_fields(spec, cls._FIELDS, field)
        kwargs = {name: get_field(spec, name) for name in cls._FIELDS}
        kwargs["dist"] = get_field(spec, "dist", "fixed")
        return cls(field=field, **kwargs)

    def scaled(self, scale: float) -> LengthSpec:
        """Every length parameter multiplied by `scale` (rounded, at least 1); sigma is unchanged."""
        if scale == 1.0:
            return self

        def s(x):
            return None if x is None else max(1, round(x * scale))

        def sf(x):
            return None if x is None else x * scale

        return dataclasses.replace(
            self,
            value=s(self.value),
            low=s(self.low),
            high=s(self.high),
            median=sf(self.median),
            mean=sf(self.mean),
            min=s(self.min),
            max=s(self.max),
        )

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """`n` lengths as an int64 array."""
        if self.dist == "fixed":
            return np.full(n, int(self.value), dtype=np.int64)
        if self.dist == "uniform":
            return rng.integers(int(self.low), int(self.high) + 1, size=n, dtype=np.int64)
        sigma = float(self.sigma)
        mu = math.log(self.median) if self.median is not None else math.log(self.mean) - sigma**2 / 2
        x = np.rint(rng.lognormal(mu, sigma, size=n))
        lo = int(self.min) if self.min is not None else 1
        hi = int(self.max) if self.max is not None else np.iinfo(np.int64).max
        return np.clip(x, lo, hi).astype(np.int64)
