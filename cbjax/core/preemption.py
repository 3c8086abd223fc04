"""Preemption, the scheduler's part that takes running requests off the device: by swap (their computed KV moves
to host pages) or by recompute (their KV is dropped and computed again on resume).

Kept out of scheduler.py, which calls these with itself as `sched` (not imported here, like multi_step.py); they
read only the scheduler's public state (running, waiting, pool, host_pool, policy, counters).
"""

from cbjax.core.request import Request, RequestStatus
from cbjax.core.scheduler_config import pages_for
from cbjax.core.step_plan import StepPlan


def preempt_lower(sched, req: Request, lower_ranked: list[Request], step: StepPlan, *, slots: int, target: int) -> bool:
    """Preempt running requests ranked below `req` (as the policy allows) until `slots` > 0 slots are free for it
    (a group that forks takes one per sample: sequence_group.slots_wanted) or, with `slots` 0, `target` pages are
    free. Returns whether that was reached; preempts nobody when it cannot be."""
    max_len = sched.config.max_model_len
    lower = [r for r in lower_ranked if r.status is RequestStatus.RUNNING and not r.pending_is_final(max_len)]
    candidates = sched.policy.victims(req, lower)
    if not candidates:
        return False
    if slots:
        if sched.num_free_slots() + len(candidates) < slots:
            return False  # even all of them would not free enough slots
    elif sched.pool.num_free + sum(len(c.pages) for c in candidates) < target:
        return False  # even all of them would not free enough: preempting would only waste their work
    while candidates:
        victim = sched.policy.choose_victim(candidates, step.out.time)
        candidates = [c for c in candidates if c is not victim]
        preempt(sched, victim, step)
        if (sched.num_free_slots() >= slots) if slots else sched.pool.can_allocate(target):
            return True
    return False


def preempt(sched, req: Request, step: StepPlan) -> None:
    """Take a running request off the device. Swap mode moves the KV of its computed tokens to host pages
    (when the host pool has room); otherwise the KV is dropped and recomputed on resume. Either way it goes
    back to the waiting queue, keeping its generated tokens. (A sample of a forked group goes alone: pages it
    shares with its siblings lose one reference, and it comes back with pages of its own.)"""
    sched.running.remove(req)
    sched.left_running(req)
    # Without device pages (admitted in a static batch, not placed yet) it holds nothing to move or drop: a
    # swapped-out request keeps its host pages.
    if req.pages:
        k = pages_for(req.num_computed_tokens, sched.cache.page_size) - req.num_dropped_pages  # held, computed
        host = sched.host_pool
        if host is not None and k > 0 and host.can_allocate(k):
            req.host_pages = host.allocate(k)
            step.out.swap_out.extend(zip(req.pages[:k], req.host_pages))
            sched.num_swapped_out_pages += k
        else:
            sched.num_recomputed_tokens += req.num_computed_tokens
            req.num_computed_tokens = 0
            req.num_dropped_pages = 0
        sched.pool.free(req.pages)
        req.pages = []
    req.num_registered_pages = 0
    req.status = RequestStatus.PREEMPTED
    req.num_preemptions += 1
    req.metrics.num_preemptions += 1
    sched.num_preemptions += 1
    step.out.preempted.append(req)
    step.preempted.add(id(req))
    sched.waiting.append(req)
