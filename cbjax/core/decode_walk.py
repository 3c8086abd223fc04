"""The scheduler's walk over the ranking, the decodes of running sequences planned inline.

Why: a simulated run spends most of its time planning decodes (one token for a running sequence whose pages are
at hand), and through the general path each cost a handful of method calls (`_extend`, `_num_new_tokens`,
`_scheduled`, `pending_is_final`, `append_pending_token`, the policy's empty `on_scheduled`): about half of the
scheduler's time in a cProfile of the zoo's fcfs run. Here one loop does what that path does for a decode, with
its state read once per step, and hands every other visit back to the scheduler's general path.

Kept out of scheduler.py, which walks `general_visits` with itself as `sched` (not imported here); it reads the
scheduler's public state (pool, cache, config, policy) and the same fields of a Request that the general path does.
"""

from collections.abc import Iterator

from cbjax.core.policy import scheduled_hook
from cbjax.core.request import PENDING_TOKEN, Request, RequestStatus
from cbjax.core.scheduler_output import ScheduledSeq
from cbjax.core.sorted_ranking import Ranking, visits

_RUNNING = RequestStatus.RUNNING


def general_visits(sched, ranking: Ranking, step, drafting: bool) -> Iterator[tuple[Request, int]]:
    """The visits `(req, lower)` of this step's walk over `ranking` (the order of sorted_ranking.visits, which it
    walks itself, one generator fewer per sequence) that the scheduler's general path must handle, in order;
    meanwhile each running sequence's decode is planned inline exactly as the general path would plan it, and the
    visits the general path would skip are skipped. Ends with the walk or when the step's budget is spent.

    A visit is planned here when it is a running sequence (not preempted this step, its final token not pending)
    with pages, no drafts this step, one uncomputed token (a decode), in no sequence group and holding no shared
    page, and its next page (if it needs one) is free: the general path would give it that token with nothing else
    to decide. Anything else (a waiting request, a prompt chunk, a sample of a group, a page to free first) is
    yielded unchanged."""
    policy, max_len = sched.policy, sched.config.max_model_len
    chunk_size = policy.chunk_size
    if drafting or (chunk_size is not None and chunk_size < 1):
        for visit in visits(ranking, step):  # nothing to plan inline: only the skips
            if step.budget <= 0:
                return
            if not _skipped(visit[0], step, max_len):
                yield visit
        return
    hook = scheduled_hook(policy)  # (None: the base class's, which does nothing; a policy that overrides it is called)
    preempted = step.preempted
    pool, G, choose = sched.pool, sched.cache.page_size, policy.choose_eviction
    out = step.out
    add, now = out.seqs.append, out.time
    running = ranking.running
    num_running, i = len(running), 0  # running[:i] visited
    order, tail = iter(ranking.order), False
    # The budget is a local between visits handed to the general path (written back before each yield and return,
    # read again after): one attribute write fewer per decode.
    budget = step.budget
    while True:
        for req in order:
            # sorted_ranking.visits: a running request passes `lower` (where those ranked below it start in
            # `running`); once no waiting request may join, the walk jumps to the running ones left (the tail).
            if tail or (i < num_running and running[i] is req):
                i += 1
            elif not step.may_admit:
                order, tail = iter(running[i:]), True
                break
            if budget <= 0:
                step.budget = budget
                return
            if req.status is not _RUNNING:
                if not _skipped(req, step, max_len):
                    step.budget = budget
                    yield req, i
                    budget = step.budget
                continue
            if preempted and id(req) in preempted:
                continue
            toks, outs = req.all_token_ids, req.output_token_ids
            num_toks = len(toks)
            if req.num_pending_tokens > 0 and (len(outs) >= req.params.max_tokens or num_toks >= max_len):
                continue  # its final token is pending (Request.pending_is_final)
            computed = req.num_computed_tokens
            pages = req.pages
            if not pages or num_toks - computed != 1 or req.group is not None or req.shares_pages:
                step.budget = budget
                yield req, i
                budget = step.budget
                continue
            new_pages = (computed + G) // G - req.num_dropped_pages - len(pages)  # pages_for(computed + 1) - have
            if new_pages > 0:
                if new_pages > pool.num_free:
                    step.budget = budget
                    yield req, i  # the general path makes room
                    budget = step.budget
                    continue
                pages.extend(pool.allocate(new_pages, choose))
            # As the general path schedules one decode token: computed from now on, its token pending until update.
            add(ScheduledSeq(req, computed, 1, True))  # (no drafts: the field's default, an empty tuple)
            budget -= 1
            m = req.metrics
            if m.first_scheduled_time is None:
                m.first_scheduled_time = now
            req.last_scheduled_time = now
            if hook is not None:
                hook(req, 1, now)
            req.num_computed_tokens = computed + 1
            outs.append(PENDING_TOKEN)
            toks.append(PENDING_TOKEN)
            req.num_pending_tokens += 1
        else:
            step.budget = budget
            return


def _skipped(req, step, max_len: int) -> bool:
    """Whether the walk passes over `req` this step: preempted by this step, waiting while no request may join,
    or its final token pending."""
    return (
        id(req) in step.preempted
        or (req.status is not _RUNNING and not step.may_admit)
        or (req.num_pending_tokens > 0 and req.pending_is_final(max_len))
    )
