"""A comparison's workload over time: its requests per seed, the rate a `workload.load` resolves to, and when a run
ends. The harness (experiments/compare_policies.py) measures the reference policy's capacity with its own engines
and hands the figures here; nothing in this module builds an engine.

A load (config.workload.load = L) is a rate stated as L x the offline capacity of config.capacity.policy (fcfs by
default), measured on the same requests and engine options in the same sitting (cbjax/bench/capacity.py), so the
same config measures the same regime on any machine, accelerator or simulator.
"""

from __future__ import annotations

from cbjax.bench.capacity import check_load


def load_of(cfg) -> float | None:
    """config.workload.load, checked; None when the workload's request_rate is absolute (load None or 0)."""
    return check_load(cfg.workload.get("load"), cfg.workload.get("arrival"))


def capacity_policy(cfg) -> str:
    """The entry whose offline capacity a workload.load is relative to (config.capacity.policy, default fcfs)."""
    return (cfg.get("capacity") or {}).get("policy", "fcfs")


def capacity_runs(cfg) -> int:
    """How many offline runs the capacity is the median of (config.capacity.runs, default 1)."""
    return int((cfg.get("capacity") or {}).get("runs", 1))


def workload_config(cfg, *, seed_offset: int = 0, offline: bool = False, request_rate: float | None = None):
    """The fields of cbjax.bench.workload.make_workload from config.workload: its seed moved by `seed_offset`,
    without `load` (the harness's: `request_rate` passes the rate it resolved to, a replayed trace's trace_rate);
    `offline`: all at t=0."""
    w = cfg.workload.copy_and_resolve_references()
    with w.unlocked():
        w.seed = cfg.workload.seed + seed_offset
        if "load" in w:
            del w["load"]
        if request_rate is not None and w.get("arrival") == "trace":
            w.trace_rate = request_rate  # the trace's own bursts, compressed or stretched to the rate
        elif request_rate is not None:
            w.request_rate = request_rate
        if offline:
            w.arrival, w.request_rate = "offline", None
            if "trace_rate" in w:
                w.trace_rate = None
    return w


def workloads_at(cfg, *, seeds: int, request_rate: float | None = None, first=None) -> list:
    """The workload of each seed (workload.seed, +1, ...), at `request_rate` when a load resolved one; `first`, when
    given, is seed 0's already made."""
    from cbjax.bench.workload import make_workload

    return [
        first
        if first is not None and s == 0
        else make_workload(workload_config(cfg, seed_offset=s, request_rate=request_rate))
        for s in range(seeds)
    ]


def horizon_of(cfg, workload) -> float | None:
    """When each run ends (s from the start): config.horizon_s, or config.horizon_after_last_arrival_s after the
    workload's last arrival (a load sets the arrival span, so a fixed horizon would cut a different share of the
    run on another machine), the earlier of the two when both are set; None: when every request has finished."""
    ends = [cfg.get("horizon_s")]
    if cfg.get("horizon_after_last_arrival_s") is not None and workload:
        ends.append(max(r.arrival_time for r in workload) + cfg.horizon_after_last_arrival_s)
    ends = [e for e in ends if e is not None]
    return min(ends) if ends else None
