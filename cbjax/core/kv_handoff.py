"""Disaggregated serving, the schedulers' part: a prefill engine's scheduler keeps a finished request's KV pages
until they are copied to a decode engine (`KVHandoff`), and a decode engine's scheduler admits a request whose
prompt was computed elsewhere straight into its running set, with pages for the KV that is about to be written
(`admit_prefilled`); `decode_request` is the request it runs (the prefill engine's one-token request, continued).

vLLM's KV connectors do the same two things: the prefill side delays freeing a finished request's blocks until
its KV is sent, the decode side allocates blocks for a request whose KV comes from a remote prefill. The engine
side (the copy itself, the routing) is cbjax/disaggregated.py and cbjax/runner/kv_transfer.py. Kept out of
scheduler.py, which only asks `keeps` when a request finishes.
"""

import dataclasses

from cbjax.core.page_pool import PagePool
from cbjax.core.request import FinishReason, Request


class KVHandoff:
    """A scheduler's requests whose pages outlive their finish: marked by `hold` when they are added, their pages
    are kept when they finish (unless aborted) until `release` frees them."""

    def __init__(self, pool: PagePool):
        self.pool = pool
        self.marked: set[Request] = set()
        self.held: dict[Request, list[int]] = {}

    def hold(self, req: Request) -> None:
        """Keep `req`'s pages when it finishes."""
        self.marked.add(req)

    def keeps(self, req: Request, reason: FinishReason) -> bool:
        """Called by Scheduler.finish: whether it keeps `req`'s pages (the scheduler then does not free them)."""
        if req not in self.marked:
            return False
        self.marked.discard(req)
        if reason is FinishReason.ABORT:
            return False  # an aborted request's KV goes nowhere
        self.held[req] = list(req.pages)
        return True

    def pages(self, req: Request) -> list[int]:
        """The pages kept for `req` (its KV of positions [req.num_dropped_pages * G, req.num_computed_tokens))."""
        return self.held[req]

    def release(self, req: Request) -> None:
        """Free the pages kept for `req` (its KV was copied, or is not wanted any more)."""
        self.pool.free(self.held.pop(req))

    @property
    def num_held_pages(self) -> int:
        return sum(len(p) for p in self.held.values())


def admit_prefilled(sched, req: Request, num_pages: int) -> list[int] | None:
    """Admit `req`, whose first `req.num_computed_tokens` tokens have their KV computed by another engine, into
    `sched`'s running set with `num_pages` fresh pages for that KV (returned: the caller writes them before the
    next step runs). None, and nothing changed, unless the scheduler has nothing waiting (its preempted requests
    resume first), a free slot, and the pages plus its watermark free. `sched` is a Scheduler (not imported here,
    as in preemption.py)."""
    pool = sched.pool
    watermark = sched.watermark_pages if sched.running else 0
    if sched.waiting or sched.num_free_slots() < 1 or not pool.can_allocate(num_pages + watermark):
        return None
    sched.policy.on_arrival(req, sched.clock.now())
    sched.waiting.append(req)
    sched.admit(req)
    req.pages = pool.allocate(num_pages, sched.policy.choose_eviction)
    req.num_registered_pages = 0  # offered to the prefix cache at its next update, as any computed page
    return req.pages


def decode_request(pre: Request, max_tokens: int, arrival_order: int) -> Request:
    """The request a decode engine runs after `pre` (finished on its prefill engine with its first token, its KV
    held there): the same prompt, seed and parameters but max_tokens, its first token received, its prompt
    computed, its timestamps so far (the first token's time is set when its KV arrives)."""
    params = dataclasses.replace(pre.params, max_tokens=max_tokens)
    req = Request(
        pre.request_id,
        pre.prompt_token_ids,
        params,
        pre.metrics.arrival_time,
        pre.seed,
        arrival_order,
        priority=pre.priority,
        tenant=pre.tenant,
        deadline=pre.deadline,
    )
    req.append_token(pre.output_token_ids[0])
    req.num_computed_tokens = pre.num_computed_tokens
    req.num_dropped_pages = pre.num_dropped_pages
    req.num_preemptions = pre.num_preemptions
    req.metrics.first_scheduled_time = pre.metrics.first_scheduled_time
    req.metrics.num_preemptions = pre.metrics.num_preemptions
    return req
