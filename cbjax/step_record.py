"""The record of one engine step (LLMEngine.step_records): what it scheduled, what it cost the host and the
device, and its share of the scheduler's cumulative counters (preemptions, recomputed and prefix-cached tokens)."""

import operator

from cbjax.core.host_prefix_cache import host_cache_counters

# The scheduler's cumulative counters a step record holds its share of, the host cache tier's last (zero without one).
COUNTER_NAMES = ("num_preemptions", "recomputed_tokens", "prefix_queried_tokens", "prefix_hit_tokens")
COUNTER_NAMES += tuple(host_cache_counters(None))
_NO_HOST_CACHE = tuple(host_cache_counters(None).values())


def scheduler_counters(sched) -> tuple[int, ...]:
    """The scheduler's cumulative counters, in COUNTER_NAMES' order. A tuple: read twice per step, and a dict each
    time was ~1% of a simulated run."""
    pool, host_cache = sched.pool, sched.host_cache
    return (
        sched.num_preemptions,
        sched.num_recomputed_tokens,
        pool.queried_tokens,
        pool.hit_tokens,  # both tiers
        *(_NO_HOST_CACHE if host_cache is None else host_cache_counters(host_cache).values()),
    )


def counters_since(sched, before: tuple[int, ...]) -> dict[str, int]:
    """How much each counter grew since `before` (scheduler_counters then): a step's share, by name."""
    return dict(zip(COUNTER_NAMES, map(operator.sub, scheduler_counters(sched), before)))


def step_record(engine, handle, host_s: float, device_s: float, counts: dict[str, int]) -> dict:
    """The record of step `handle` (a runner's StepHandle) of `engine` (an LLMEngine), received now."""
    sched, out = engine.scheduler, handle.out
    pool = sched.pool
    # A dict display, not dict(**): built once per step.
    return {
        "time": engine.clock.now(),
        "scheduled_time": out.time,
        "num_running": len(sched.running),
        "num_waiting": len(sched.waiting),
        "num_scheduled_seqs": len(out.seqs),
        "max_num_seqs": engine.config.scheduler.max_num_seqs,
        "num_scheduled_tokens": out.num_batched_tokens,
        "padded_tokens": handle.padded_tokens,
        "decode_steps": out.num_steps,  # > 1: a block of decode steps (core/multi_step.py)
        "block_wasted_tokens": out.num_wasted_tokens,
        "kv_pages_used": pool.num_used,
        "kv_pages_total": pool.num_pages,
        "host_s": host_s,
        "device_s": device_s,
        "compiles": engine.runner.num_compiles,
        "swap_out_bytes": handle.swap_out_bytes,
        "swap_in_bytes": handle.swap_in_bytes,
        "swap_s": handle.swap_s,
        **counts,
    }
