"""Preemption, the scheduler's part that takes running requests off the device: by swap (their computed KV moves
to host pages) or by recompute (their KV is dropped and computed again on resume).

Kept out of scheduler.py, which calls these with itself as `sched` (not imported here, like multi_step.py); they
read only the scheduler's public state (running, waiting, pool, host_pool, policy, counters).
"""

from cbjax.core.request import Request, RequestStatus
from cbjax.core.scheduler_config import pages_for
from cbjax.core.sequence_group import park_group, preemptible_as_groups, running_members
from cbjax.core.step_plan import StepPlan


def preempt_lower(sched, req: Request, lower_ranked: list[Request], step: StepPlan, *, slots: int, target: int) -> bool:
    """Preempt running requests ranked below `req` (as the policy allows) until `slots` > 0 slots are free for it
    (a group that forks takes one per sample: sequence_group.slots_wanted) or, with `slots` 0, `target` pages are
    free. Returns whether that was reached; preempts nobody when it cannot be."""
    max_len = sched.config.max_model_len
    lower = [r for r in lower_ranked if r.status is RequestStatus.RUNNING and not r.pending_is_final(max_len)]
    candidates = preemptible_as_groups(req, sched.policy.victims(req, lower), lower)
    if not candidates:
        return False
    if slots:
        if sched.num_free_slots() + len(candidates) < slots:
            return False  # even all of them would not free enough slots
    elif sched.pool.num_free + len({p for c in candidates for p in c.pages}) < target:
        return False  # even all of them would not free enough: preempting would only waste their work
    while candidates:
        victim = sched.policy.choose_victim(candidates, step.out.time)
        preempt(sched, victim, step, alone=victim.group is not None and victim.group is req.group)
        candidates = [c for c in candidates if c.status is RequestStatus.RUNNING]  # a group goes as a whole
        if (sched.num_free_slots() >= slots) if slots else sched.pool.can_allocate(target):
            return True
    return False


def yield_pages(sched, req: Request, step: StepPlan) -> None:
    """A running request lacks pages and nothing ranked below it can give them: it yields its own (preempt), with
    its whole group when it is a sample of a forked one, except in two cases where the sample goes alone (and comes
    back with pages of its own): a sibling already scheduled in this step (it cannot be taken back), or the group
    holding the device alone (it does not fit whole, e.g. when every sample reserves its pages to completion, and
    would stall again after every re-fork). Either way the highest-ranked request that can run keeps running."""
    members = running_members(req)
    alone = False
    if len(members) > 1:
        scheduled = {id(s.request) for s in step.out.seqs}
        alone = any(id(m) in scheduled for m in members) or len(members) == len(sched.running)
    preempt(sched, req, step, alone=alone)


def preempt(sched, req: Request, step: StepPlan, alone: bool = False) -> None:
    """Take a running request off the device, with its whole group when it is a sample of a forked one
    (sequence_group.py). Swap mode moves the KV of their computed tokens to host pages (when the host pool has room
    for all of it; a page the samples share goes once); otherwise the KV is dropped and recomputed on resume. Either
    way they go back to waiting, keeping their generated tokens. None of them is scheduled in this step (victims
    rank below the requester, preempt_lower; yield_pages sends a sample alone otherwise)."""
    # (A forked group's last running sample goes alone: nothing left to share.)
    members = [req] if alone else running_members(req)
    if alone and req.group is not None:
        req.group.split = True
    held = [m for m in members if m.pages]  # (admitted in a static batch and not placed yet: holds nothing)
    k = {id(m): pages_for(m.num_computed_tokens, sched.cache.page_size) - m.num_dropped_pages for m in held}
    distinct = {p for m in held for p in m.pages[: k[id(m)]]}
    host = sched.host_pool
    if distinct and host is not None and host.can_allocate(len(distinct)):
        host_of = dict(zip(distinct, host.allocate(len(distinct))))
        step.out.swap_out.extend(host_of.items())
        sched.num_swapped_out_pages += len(distinct)
        first = set()
        for m in held:
            m.host_pages = [host_of[p] for p in m.pages[: k[id(m)]]]
            host.incref([h for h in m.host_pages if h in first])  # a host page per holder, like device pages
            first.update(m.host_pages)
    else:
        for m in held:
            sched.num_recomputed_tokens += m.num_computed_tokens
            m.num_computed_tokens = 0
            m.num_dropped_pages = 0
    for m in members:
        sched.running.remove(m)
        sched.left_running(m)
        if m.pages:
            sched.pool.free(m.pages)
            m.pages = []
        m.num_registered_pages = 0
        m.status = RequestStatus.PREEMPTED
        m.num_preemptions += 1
        m.metrics.num_preemptions += 1
        sched.num_preemptions += 1
        step.out.preempted.append(m)
        step.preempted.add(id(m))
    if len(members) > 1:
        park_group(sched, members)
    else:
        sched.waiting.append(req)
