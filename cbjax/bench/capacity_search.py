"""Capacity under an SLO: the highest arrival rate at which a policy still serves at least a given share of its
requests within their SLOs (TTFT, TPOT, E2E: cbjax.bench.metrics' slo_attainment), found by bisection over the
rate. The search only asks a function for the attainment at a rate, so it runs on the simulator, the real engine
or a test's formula alike (experiments/capacity.py drives it).

Why bisection on one workload: the workload's arrival times at rate r are one set of standard draws scaled by 1/r
(cbjax/bench/arrivals.py), so raising the rate packs the same requests closer, and attainment falls with the rate
up to noise from the policy's decisions. The search keeps the highest rate seen to meet the target, so a
non-monotone bump can only make it conservative.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable


@dataclasses.dataclass(frozen=True)
class Probe:
    """One rate tried: its attainment and whatever else the runner measured there."""

    rate: float
    attainment: float
    figures: dict = dataclasses.field(default_factory=dict)

    def meets(self, target: float) -> bool:
        return math.isfinite(self.attainment) and self.attainment >= target


@dataclasses.dataclass(frozen=True)
class SearchResult:
    """capacity: the highest rate seen to meet `target` (0.0 when even the lowest probe missed it); bounded: False
    when the target was still met at the highest rate tried (the capacity is at least that); probes: in the order
    they ran."""

    capacity: float
    bounded: bool
    probes: tuple[Probe, ...]
    target: float

    @property
    def missed_above(self) -> float:
        """The lowest rate seen to miss the target (inf when none did)."""
        return min((p.rate for p in self.probes if not p.meets(self.target)), default=math.inf)


def search_capacity(
    attainment_at: Callable[[float], Probe],
    start_rate: float,
    *,
    target: float = 0.9,
    tolerance: float = 0.02,
    max_probes: int = 16,
    floor_fraction: float = 0.05,
) -> SearchResult:
    """Bisect the rate for the highest one whose probe meets `target`.

    `attainment_at(rate)` runs the workload at `rate` and returns its Probe. `start_rate` is a first guess (the
    offline capacity is a good one): the bracket doubles from there until a probe misses, then halves until its
    width is at most `tolerance` of the rate that met. If a probe at `floor_fraction` x start_rate misses too, the
    capacity is 0 (the SLO is out of reach even nearly idle). At most `max_probes` runs in all."""
    if not 0.0 < target <= 1.0:
        raise ValueError(f"target must be a share in (0, 1], got {target!r}")
    if not (math.isfinite(start_rate) and start_rate > 0):
        raise ValueError(f"start_rate must be a rate > 0, got {start_rate!r}")
    if not 0.0 < tolerance < 1.0 or max_probes < 3:
        raise ValueError(f"tolerance must be in (0, 1) and max_probes >= 3, got {tolerance!r}, {max_probes!r}")
    probes: list[Probe] = []

    def probe(rate: float) -> Probe:
        p = attainment_at(rate)
        probes.append(p)
        return p

    def result(capacity: float, bounded: bool) -> SearchResult:
        return SearchResult(capacity, bounded, tuple(probes), target)

    lo, hi = 0.0, start_rate
    while probe(hi).meets(target):  # widen until a rate misses
        lo, hi = hi, 2.0 * hi
        if len(probes) >= max_probes - 1:
            return result(lo, False)
    floor = floor_fraction * start_rate
    if lo == 0.0:
        if not probe(floor).meets(target):
            return result(0.0, True)
        lo = floor
    while hi - lo > tolerance * lo and len(probes) < max_probes:
        mid = 0.5 * (lo + hi)
        if probe(mid).meets(target):
            lo = mid
        else:
            hi = mid
    return result(lo, True)
