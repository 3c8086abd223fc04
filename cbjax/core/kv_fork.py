"""Forking a finished request's KV into a new request that continues its context (beam search's branching).

Beam search (cbjax/beam_search.py) runs each round's beams as one-token requests. A beam's children continue its
context with one more token each: instead of computing that context again, each child takes a reference to the
parent's pages (page_pool.py counts them) for the tokens they have in common, joins the running set at once, and
computes only its own new token. The partly filled last page is the one that is both shared and written: the first
child to write into it while another still holds it gets a copy of its own (copy-on-write, the scheduler's check for
requests with `shares_pages`, as for the samples of a sequence group). Beams that die have no children: their
pages go back to the pool when the driver releases the parent. So the pages are forked and freed as beams branch
and die, as in the PagedAttention paper; the prefix cache is not needed for it.

The parent's pages outlive its finish through the scheduler's KVHandoff (core/kv_handoff.py, the mechanism
disaggregated serving uses to keep a prefill's pages until they are sent).
"""

from cbjax.core.request import Request, RequestStatus
from cbjax.core.scheduler_config import pages_for


def common_computed_prefix(child: Request, parent: Request) -> int:
    """Tokens at the start of `child`'s context whose KV `parent` has computed: the common prefix of their contexts,
    at most the parent's computed tokens, and short of the child's last token (the step must produce its logits)."""
    limit = min(parent.num_computed_tokens, len(child.all_token_ids) - 1)
    a, b = child.all_token_ids, parent.all_token_ids
    n = 0
    while n < limit and a[n] == b[n]:
        n += 1
    return n


def admit_forked(sched, child: Request, parent: Request, parent_pages: list[int]) -> bool:
    """Admit `child` (added, waiting) straight into `sched`'s running set sharing `parent_pages`, the pages the
    scheduler kept for the finished `parent`, for their common computed prefix. False, and nothing changed, when
    no slot is free, nothing is shared, or the parent dropped pages (a sliding window): the child then waits and
    computes its context like any request. `sched` is a Scheduler (not imported here, as in preemption.py)."""
    if child.status is not RequestStatus.WAITING or child.group is not None or parent.num_dropped_pages:
        return False
    n = common_computed_prefix(child, parent)
    if n == 0 or sched.num_free_slots() < 1:
        return False
    G = sched.cache.page_size
    shared = parent_pages[: pages_for(n, G)]
    sched.pool.incref(shared)
    sched.admit(child)
    child.pages = list(shared)
    child.num_computed_tokens = n
    child.page_hashes = parent.page_hashes[: n // G]
    child.num_registered_pages = min(parent.num_registered_pages, n // G)
    child.shares_pages = True
    return True
