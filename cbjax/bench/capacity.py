"""Load stated relative to capacity: a workload's arrival rate as a fraction of what a reference policy sustains.

An absolute rate (36 requests/s) names a regime only on the machine it was tuned on: on a faster machine, a TPU or
the simulator's H200 the same rate is a different regime. A load (`workload.load = 0.8`) names the regime itself:
the arrival rate is that fraction of the capacity of a reference policy (fcfs by default), the completed requests
per second it sustains with every request of the same workload queued at t=0, measured on the same engine in the
same sitting (on the simulator, on the simulated engine). Below 1 that policy keeps up; above 1 its queue grows
to the end of the run.

The workload's requests do not depend on its rate (cbjax/bench/workload.py draws them from their own random
streams), so the offline run that measures the capacity serves exactly the requests the online runs get.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Sequence

from cbjax.bench.requests import WorkloadRequest

LOAD_ARRIVALS = ("poisson", "gamma", "weibull", "trace")  # arrivals whose rate a load can set (a trace: trace_rate)


@dataclasses.dataclass(frozen=True)
class Capacity:
    """What a reference policy sustains offline: the median over `runs` of completed requests per second."""

    policy: str
    request_rate: float  # completed requests/s, median of the runs
    output_throughput: float  # output tokens/s of the same runs, median
    runs: tuple[float, ...]  # each run's completed requests/s
    num_requests: int

    def rate_at(self, load: float) -> float:
        """The arrival rate (requests/s) of `load` times this capacity."""
        return load * self.request_rate

    def header(self, load: float) -> str:
        """One line for the top of a comparison's table: the load, the capacity it is relative to, the rate."""
        spread = ""
        if len(self.runs) > 1:
            spread = f", runs {min(self.runs):.1f}-{max(self.runs):.1f}"
        return (
            f"load {load:g} x capacity of {self.policy} ({self.request_rate:.1f} req/s offline on these "
            f"{self.num_requests} requests, measured now{spread}) = {self.rate_at(load):.2f} req/s arriving"
        )

    def to_dict(self, load: float) -> dict:
        return dict(
            load=load,
            policy=self.policy,
            capacity_request_rate=self.request_rate,
            capacity_output_throughput=self.output_throughput,
            capacity_runs=list(self.runs),
            num_requests=self.num_requests,
            request_rate=self.rate_at(load),
        )


def capacity_of(policy: str, summaries: Sequence[dict], num_requests: int) -> Capacity:
    """The Capacity of `policy` from the metric summaries (cbjax.bench.metrics.summarize) of its offline runs.

    A run that completed no request, or none of the workload's requests in full, cannot state a capacity."""
    if not summaries:
        raise ValueError(f"no offline run of {policy} to measure its capacity from")
    rates = tuple(float(s["request_throughput"]) for s in summaries)
    if not all(math.isfinite(r) and r > 0 for r in rates):
        raise ValueError(f"{policy}'s offline runs completed no requests (request rates {rates}): no capacity")
    return Capacity(
        policy=policy,
        request_rate=statistics.median(rates),
        output_throughput=statistics.median(float(s["output_throughput"]) for s in summaries),
        runs=rates,
        num_requests=num_requests,
    )


def offline(workload: Sequence[WorkloadRequest]) -> list[WorkloadRequest]:
    """The same requests, all arriving at t=0 (deadlines, if any, keep their offset from the arrival)."""
    out = []
    for r in workload:
        deadline = None if r.deadline is None else r.deadline - r.arrival_time
        out.append(dataclasses.replace(r, arrival_time=0.0, deadline=deadline))
    return out


def check_load(load, arrival: str) -> float | None:
    """`workload.load` checked against the workload's arrival process: None or 0 for no load (the workload's
    request_rate is absolute; 0 because a command line cannot set a float field to None), else a finite number > 0
    with an arrival of LOAD_ARRIVALS. A load, when given, sets the rate: the workload's own request_rate is unused
    (for a replayed trace, its trace_rate: the trace is compressed or stretched to that mean rate)."""
    if load is None or (load == 0 and not isinstance(load, bool)):
        return None
    if isinstance(load, bool) or not isinstance(load, int | float) or not math.isfinite(load) or load <= 0:
        raise ValueError(f"workload.load must be a number > 0 (a fraction of the capacity), got {load!r}")
    if arrival not in LOAD_ARRIVALS:
        raise ValueError(f"workload.load sets an arrival rate: it needs arrival in {LOAD_ARRIVALS}, got {arrival!r}")
    return float(load)
