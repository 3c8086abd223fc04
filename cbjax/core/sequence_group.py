"""Sequence groups: a request with n > 1 (or best_of) samples runs them as sequences that share the prompt's KV.

As in the PagedAttention paper: the prompt is computed once, by the group's head (sample 0), up to its last
token; there the group forks: every other sample takes a reference to the head's pages (page_pool.py counts
them) and joins the running set with the same computed prefix. Each sample then computes the prompt's last token
itself (so each gets its own logits row and samples its own first token) and writes its own outputs. The one page
that can be shared *and* written is the partly filled page holding the prompt's last tokens: a sample about to
write into it while another still holds it first gets a copy of its own (copy-on-write: a device page copy the
runner performs before the step, SchedulerOutput.page_copies). Full pages stay shared for the group's life.

After the fork each sample is scheduled, preempted (recompute or swap) and finished as a sequence of its own;
the engine reports the group as one RequestOutput with a CompletionOutput per sample. A preempted sample comes
back with pages of its own (or prefix-cache hits). A group that has not forked yet holds a slot per sample, so
the fork never takes the running set past max_num_seqs.
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

    __slots__ = ("fork_point", "forked", "report_logprobs", "samples")

    def __init__(self, samples: list[Request]):
        if len(samples) < 2:
            raise ValueError("a sequence group has at least 2 samples")
        self.samples = samples
        # Where the samples part: the prompt's last token is computed by each sample (it samples from its logits).
        self.fork_point = samples[0].num_prompt_tokens - 1
        self.forked = False
        # False: logprobs computed only to rank best_of's samples, left out of the outputs (the engine sets it).
        self.report_logprobs = True
        for r in samples:
            r.group = self

    @property
    def head(self) -> Request:
        return self.samples[0]

    @property
    def finished(self) -> bool:
        return all(r.status is RequestStatus.FINISHED for r in self.samples)

    def fork(self, pool: PagePool, page_size: int) -> list[Request]:
        """Give every other sample a reference to the head's pages of the first `fork_point` tokens and the head's
        progress; returns them (to join the running set). The head has scheduled (not necessarily run) those
        tokens: the samples are scheduled from the next step on, after them."""
        head = self.head
        shared = head.pages[: max(0, pages_for(self.fork_point, page_size) - head.num_dropped_pages)]
        siblings = self.samples[1:]
        for r in siblings:
            pool.incref(shared)
            r.pages = list(shared)
            r.num_dropped_pages = head.num_dropped_pages
            r.num_computed_tokens = self.fork_point
            full = self.fork_point // page_size
            r.page_hashes = head.page_hashes[:full]
            r.num_registered_pages = min(head.num_registered_pages, full)
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
    """At the start of a step: fork every group whose head has computed (or has scheduled) the prompt up to the
    fork point; the samples join the running set, admitted with the head (its admission order), and may run in
    this step. (Never in the step that writes the shared pages: a page is written only while its writer alone
    holds it.) `sched` is the Scheduler (not imported here: it calls this with itself)."""
    for head in [h for h in sched.forking if h.num_computed_tokens >= h.group.fork_point]:
        fork_group(sched, head, now)


def fork_group(sched, head: Request, now: float) -> None:
    """Fork `head`'s group now (fork_ready_groups; or the scheduler, when a head's prompt came from the prefix
    cache up to the fork): its other samples join the running set."""
    sched.forking.remove(head)
    for sibling in head.group.fork(sched.pool, sched.cache.page_size):
        sched.policy.on_arrival(sibling, now)
        sibling.status = RequestStatus.RUNNING
        sibling.admission_order = head.admission_order
        sibling.last_scheduled_time = head.last_scheduled_time
        sched.running.append(sibling)


def slots_wanted(req: Request) -> int:
    """Slots a waiting request takes when admitted: one, or one per sample for a group that has not forked."""
    group = req.group
    return 1 if group is None or group.forked else len(group.samples)


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
