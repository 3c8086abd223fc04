"""Sequence groups: a request with n > 1 (or best_of) samples runs them as sequences that share the prompt's KV.

As in the PagedAttention paper: the prompt is computed once, by the group's leader (sample 0 at first), up to its
last token; there the group forks: every other unfinished sample takes a reference to the leader's pages (page_pool.py
counts them) and joins the running set with the same computed prefix. Each sample then computes the prompt's last
token itself (so each gets its own logits row and samples its own first token) and writes its own outputs. The one
page that can be shared *and* written is the partly filled page holding the prompt's last tokens: a sample about to
write into it while another still holds it first gets a copy of its own (copy-on-write: a device page copy the
runner performs before the step, SchedulerOutput.page_copies). Full pages stay shared for the group's life.

A forked group is preempted, swapped and resumed as a whole (vLLM v0's sequence groups; preemption.py):
- it is a victim only when all its running samples rank below the request that needs room; a sample that lacks
  pages (nothing below it to preempt) yields its group, or yields alone when a sibling is already scheduled in the
  step or the group holds the device alone (preemption.yield_pages: it then comes back with pages of its own, and
  the group is `split`: its samples are preempted one by one from then on);
- by swap, each page the samples share goes to host memory once (host pages counted by reference like device ones),
  and on resume the group comes back in one step, its shared host pages mapped to one device page again;
- by recompute, the group un-forks: its pages are dropped, its first unfinished sample leads it back through the
  waiting queue and computes the prompt once more, and the group forks again at the same point (each sample then
  recomputes its own outputs' KV).
While preempted, the samples other than the leader wait inside the group (in neither the running set nor the waiting
queue); the leader holds a slot for each of them when admitted. Samples finish on their own (their stop
conditions); the engine reports the group as one RequestOutput with a CompletionOutput per sample.
"""

from cbjax.core.outputs import RequestOutput
from cbjax.core.page_pool import PagePool
from cbjax.core.request import Request, RequestStatus
from cbjax.core.scheduler_config import pages_for

# Each sample's seed stream: the request's seed mixed with the sample's index (sample 0 keeps the request's seed,
# so n = 1 and the first of n samples draw the same tokens).
_SEED_MIX = 0x9E3779B1


def sample_seed(seed: int, index: int) -> int:
    """Sample `index`'s seed, reproducible from the request's `seed`; distinct per sample."""
    return (seed + index * _SEED_MIX) % 2**32


class SequenceGroup:
    """The samples of one request (Requests with `group` set to this), sample 0 first: the head."""

    __slots__ = ("followers", "fork_point", "forked", "leader", "num_forks", "report_logprobs", "samples", "split")

    def __init__(self, samples: list[Request]):
        if len(samples) < 2:
            raise ValueError("a sequence group has at least 2 samples")
        self.samples = samples
        # Where the samples part: the prompt's last token is computed by each sample (it samples from its logits).
        self.fork_point = samples[0].num_prompt_tokens - 1
        self.forked = False
        self.num_forks = 0
        # The sample that carries the group while it is not forked (computes the prompt, holds the slots, waits in
        # the queue): the head at first, the first unfinished sample after a preemption.
        self.leader = samples[0]
        # The unfinished samples the next fork brings in: all but the head at first, those preempted with the
        # leader after that (a sample preempted alone waits in the queue on its own instead).
        self.followers = samples[1:]
        # Once a sample has been preempted alone (preemption.yield_pages), the samples no longer share what a group
        # preempted as a whole shares, and bringing them back together could need more pages than the pool has:
        # from then on each is preempted on its own.
        self.split = False
        # False: logprobs computed only to rank best_of's samples, left out of the outputs (the engine sets it).
        self.report_logprobs = True
        for r in samples:
            r.group = self
            r.shares_pages = True

    @property
    def head(self) -> Request:
        return self.samples[0]

    @property
    def finished(self) -> bool:
        return all(r.status is RequestStatus.FINISHED for r in self.samples)

    def fork(self, pool: PagePool, page_size: int) -> list[Request]:
        """Give every follower a reference to the leader's pages of the first `fork_point` tokens and that
        progress; returns them (to join the running set). The leader has scheduled (not necessarily run) those
        tokens: the samples are scheduled from the next step on, after them."""
        leader = self.leader
        shared = leader.pages[: max(0, pages_for(self.fork_point, page_size) - leader.num_dropped_pages)]
        siblings, self.followers = self.followers, []
        for r in siblings:
            pool.incref(shared)
            r.pages = list(shared)
            r.num_dropped_pages = leader.num_dropped_pages
            r.num_computed_tokens = self.fork_point
            full = self.fork_point // page_size
            r.page_hashes = leader.page_hashes[:full]
            r.num_registered_pages = min(leader.num_registered_pages, full)
        self.forked = True
        return siblings


def make_group(head: Request, num_samples: int) -> SequenceGroup:
    """The group of `num_samples` samples whose first is `head` (a fresh request): the others are copies of it
    with their own seed streams (sample_seed), named `<request id>#<index>` (never looked up by that name: the
    engine keeps the group under the head's id)."""
    siblings = [
        Request(
            f"{head.request_id}#{i}",
            head.prompt_token_ids,
            head.params,
            head.metrics.arrival_time,
            sample_seed(head.seed, i),
            head.arrival_order,
            priority=head.priority,
            tenant=head.tenant,
            deadline=head.deadline,
        )
        for i in range(1, num_samples)
    ]
    for r in siblings:
        r.bad_word_ids = head.bad_word_ids
    return SequenceGroup([head, *siblings])


def samples_of(req: Request) -> "list[Request] | tuple[Request]":
    """Every sample of `req`'s group, or just `req`."""
    return (req,) if req.group is None else req.group.samples


def fork_ready_groups(sched, now: float) -> None:
    """At the start of a step: fork every group whose leader has computed (or has scheduled) the prompt up to the
    fork point; the samples join the running set, admitted with the leader (its admission order), and may run in
    this step. (Never in the step that writes the shared pages: a page is written only while its writer alone
    holds it.) `sched` is the Scheduler (not imported here: it calls this with itself)."""
    for leader in [h for h in sched.forking if h.num_computed_tokens >= h.group.fork_point]:
        fork_group(sched, leader, now)


def fork_group(sched, leader: Request, now: float, step=None) -> None:
    """Fork `leader`'s group now (fork_ready_groups; or the scheduler, when a leader's prompt came from the prefix
    cache up to the fork, or from host memory after a swap): its followers join the running set. A swapped group's
    followers bring their KV back from host memory (`step`, the StepPlan, collects the copies)."""
    sched.forking.remove(leader)
    group = leader.group
    if any(r.host_pages for r in group.followers):
        siblings, group.followers = _swap_in_followers(sched, leader, group.followers, step), []
        group.forked = True
    else:
        siblings = group.fork(sched.pool, sched.cache.page_size)
    for sibling in siblings:
        if group.num_forks == 0:  # the policy met them once, when they arrived with the group
            sched.policy.on_arrival(sibling, now)
        sibling.status = RequestStatus.RUNNING
        sibling.admission_order = leader.admission_order
        sibling.last_scheduled_time = leader.last_scheduled_time
        sched.running.append(sibling)
    group.num_forks += 1


def _swap_in_followers(sched, leader: Request, followers: list[Request], step) -> list[Request]:
    """The followers of a group swapped out as a whole (preemption.py) get device pages for their host pages: a
    host page the leader (or an earlier follower) brought back maps to that same device page, another gets a
    fresh device page and a host-to-device copy. The leader's placement counted these pages
    (`follower_swap_in_pages`), so they are free."""
    pool, out = sched.pool, step.out
    mine = set(leader.pages)
    device_of = {h: d for h, d in out.swap_in if d in mine}  # the leader's swap-ins, just planned
    for r in followers:
        pages = []
        for h in r.host_pages:
            d = device_of.get(h)
            if d is None:
                (d,) = pool.allocate(1, sched.policy.choose_eviction)
                out.swap_in.append((h, d))
                sched.num_swapped_in_pages += 1
                device_of[h] = d
            else:
                pool.incref([d])
            pages.append(d)
        step.host_frees.extend(r.host_pages)
        r.host_pages, r.pages = [], pages
    # The leader is scheduled in this step and writes from its computed position on: its own copy of a partly
    # filled page it now shares (follower_swap_in_pages counted the page).
    copy = copy_on_write(pool, leader, sched.cache.page_size, sched.policy.choose_eviction)
    if copy is not None:
        out.page_copies.append(copy)
    return followers


def follower_swap_in_pages(req: Request, page_size: int) -> int:
    """Device pages, beyond its own, that admitting `req` takes: when it leads a group swapped out as a whole, the
    followers' host pages it does not share (they come back in the same step), and a copy of its partly filled
    last page when a follower shares it (the leader writes into it in that step: _swap_in_followers)."""
    if not leads_unforked(req):
        return 0
    group = req.group
    theirs = {h for r in group.followers for h in r.host_pages}
    extra = len(theirs - set(req.host_pages))
    computed = req.num_computed_tokens
    last = computed // page_size - req.num_dropped_pages
    if computed % page_size and 0 <= last < len(req.host_pages) and req.host_pages[last] in theirs:
        extra += 1
    return extra


def preemptible_as_groups(requester: Request, candidates: list[Request], lower: list[Request]) -> list[Request]:
    """The victim candidates whose whole group can go: a sample of a forked group only when every running sample
    of it ranks below the requester (in `lower`, not scheduled yet this step). A sibling of the requester is a
    candidate on its own (it goes alone: the requester stays)."""
    if all(c.group is None for c in candidates):
        return candidates
    below = {id(r) for r in lower}

    def whole(c: Request) -> bool:
        g = c.group
        if g is None or not g.forked or g.split or g is requester.group:
            return True
        return all(id(s) in below for s in g.samples if s.status is RequestStatus.RUNNING)

    return [c for c in candidates if whole(c)]


def running_members(req: Request) -> list[Request]:
    """What preempting `req` takes off the device: every running sample of its forked group, or `req` alone."""
    group = req.group
    if group is None or not group.forked or group.split:
        return [req]
    return [s for s in group.samples if s.status is RequestStatus.RUNNING]


def park_group(sched, members: list[Request]) -> None:
    """After preempting a forked group's `members` (preemption.py): the first leads the group back through the
    waiting queue, the others wait inside the group; the group forks again when the leader is admitted."""
    group, leader = members[0].group, members[0]
    group.forked = False
    group.leader, group.followers = leader, members[1:]
    sched.waiting.append(leader)


def hand_over(sched, req: Request) -> None:
    """`req` finished: it no longer joins a fork; when it led a preempted group back (waiting, not forked), the
    next follower leads instead (else the followers would never be admitted)."""
    group = req.group
    if req in group.followers:
        group.followers.remove(req)
    elif group.leader is req and not group.forked and group.num_forks and group.followers:
        group.leader = group.followers.pop(0)
        sched.waiting.append(group.leader)


def leads_unforked(req: Request) -> bool:
    """Whether `req` leads a group that has not forked (yet, or again after a preemption): it computes the prompt
    up to the fork point and holds a slot per follower."""
    group = req.group
    return group is not None and not group.forked and group.leader is req


def slots_wanted(req: Request) -> int:
    """Slots a waiting request takes when admitted: one, or one per unfinished sample for a group it leads that
    has not forked."""
    return 1 + len(req.group.followers) if leads_unforked(req) else 1


def shared_write_page(pool: PagePool, req: Request, page_size: int) -> int:
    """Where in `req.pages` the next write lands in a partly filled page that another sequence still holds, or -1
    (the write starts a fresh page, or the page is its own)."""
    computed = req.num_computed_tokens
    if computed % page_size == 0:
        return -1
    i = computed // page_size - req.num_dropped_pages
    if 0 <= i < len(req.pages) and pool.refcount(req.pages[i]) > 1:
        return i
    return -1


def copy_on_write(pool: PagePool, req: Request, page_size: int, choose_eviction=None) -> tuple[int, int] | None:
    """Before `req` writes into a shared partly filled page: give it a fresh page in its place, dropping its
    reference to the shared one. Returns (source page, destination page) for the device copy, or None when no
    copy is needed. The caller made sure a page is free."""
    i = shared_write_page(pool, req, page_size)
    if i < 0:
        return None
    src = req.pages[i]
    (dst,) = pool.allocate(1, choose_eviction)
    pool.free([src])
    req.pages[i] = dst
    return src, dst


def group_problem(params, max_num_seqs: int, speculative: bool, structured: bool) -> str | None:
    """Why a request with these params cannot run as a group on this engine (None: it can). The rules: every
    sample must fit in the slots at once (the group is admitted whole); best_of > n ranks samples by cumulative
    log-probability, meaningless for greedy samples, which are all equal (vLLM refuses it too)."""
    k = params.num_samples
    if k > max_num_seqs:
        return f"n/best_of ({k}) exceeds max_num_seqs={max_num_seqs}: the samples must run together"
    if params.greedy and k > params.n:
        return "best_of > n needs sampling (temperature > 0): greedy samples are all equal"
    if speculative:
        return "n > 1 or best_of with speculative decoding is not supported"
    if structured:
        return "n > 1 or best_of with structured output is not supported"
    return None


def group_output(group: SequenceGroup, outputs: list[RequestOutput]) -> RequestOutput:
    """The group's RequestOutput, from its samples' own (one each, in sample order; the head's carries the
    request's fields): a CompletionOutput per sample, `index` its sample's, finished once every sample is. Once
    finished, with best_of > n, the n samples of highest cumulative log-probability, best first, indexed 0..n-1
    (vLLM); until then every sample streams."""
    completions = [o.outputs[0] for o in outputs]
    for i, c in enumerate(completions):
        c.index = i
    out, finished = outputs[0], group.finished
    n = group.head.params.n
    if finished and len(completions) > n:
        completions = sorted(completions, key=lambda c: -c.cumulative_logprob)[:n]
        for i, c in enumerate(completions):
            c.index = i
    if not group.report_logprobs:
        for c in completions:
            c.logprobs = c.cumulative_logprob = None
    out.outputs, out.finished = completions, finished
    return out
