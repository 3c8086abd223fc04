"""The policy zoo: every policy reachable by name, and `make_policy`. The interface is in policy.py."""

import heapq
import inspect
import itertools
import math
from bisect import bisect_left
from collections.abc import Iterator, Mapping, Sequence

from cbjax.config import validation as check
from cbjax.core.length_aware import HRRNPolicy, LengthAwarePolicy, ResidualSJFPolicy, SLOAwarePolicy
from cbjax.core.mlfq import MLFQPolicy
from cbjax.core.policy import Policy, by_admission, fcfs_order
from cbjax.core.priority import PriorityPolicy
from cbjax.core.request import Request, RequestStatus
from cbjax.core.sorted_ranking import arrival_key, by_arrival_of, merge_by_key, running_first, waiting_first


class FCFSPolicy(Policy):
    """Continuous FCFS: running sequences in admission order (decodes and unfinished chunked prefills alike), then
    waiting requests in arrival order; under memory pressure the last admitted running sequence is preempted."""

    name = "fcfs"

    def waiting_key(self, req):
        return arrival_key(req)

    def rank_sorted(self, running, waiting, now):
        return running_first(by_admission(running), waiting.requests)


class StaticPolicy(FCFSPolicy):
    """Static batching: admit up to max_num_seqs requests (the scheduler's slots, read through the view)
    together and admit nothing more until every one of them has finished. The baseline continuous batching is
    measured against, on the same runner.

    With `batch_timeout_s` > 0 a new batch also waits until it is full or its oldest request has waited that long
    (the server-side static batcher of online serving); 0 starts a batch with whatever is waiting.
    """

    name = "static"
    admits_whole_batch = True

    def __init__(self, batch_timeout_s: float = 0.0, victim: str = "rank"):
        super().__init__(victim)
        self.batch_timeout_s = check.real("static batch_timeout_s", batch_timeout_s, 0.0)

    def may_admit(self, running: Sequence[Request], waiting: Sequence[Request], now: float) -> bool:
        if running or not waiting:
            return False
        if self.batch_timeout_s <= 0 or len(waiting) >= self.view.max_num_seqs:
            return True
        return now - min(r.metrics.arrival_time for r in waiting) >= self.batch_timeout_s

    def next_event_time(self, running, waiting) -> float | None:
        if self.batch_timeout_s > 0 and waiting and not running:
            return min(r.metrics.arrival_time for r in waiting) + self.batch_timeout_s
        return None


class PrefillFirstPolicy(Policy):
    """Orca / vLLM-V0-like: new prompts first, whole (no chunking), then running decodes with what budget is left.
    Low TTFT while the budget lasts; decodes stall behind big prefills (TPOT and ITL pay)."""

    name = "prefill_first"
    chunked_prefill = False

    def waiting_key(self, req):
        return arrival_key(req)

    def rank_sorted(self, running, waiting, now):
        return waiting_first(by_admission(running), waiting.requests)


class SarathiPolicy(Policy):
    """Sarathi-Serve's stall-free batching: every running decode first, then unfinished chunked prefills, then new
    prompts, chunked to fill the budget (`chunk_size` caps one prompt's share of a step). Decodes never wait
    behind a prefill."""

    name = "sarathi"
    chunked_prefill = True

    def __init__(self, chunk_size: int | None = None, victim: str = "rank", reserve_to_completion: bool | None = None):
        super().__init__(victim, reserve_to_completion)
        self.chunk_size = check.optional_integer("sarathi chunk_size", chunk_size, 1)

    def waiting_key(self, req):
        return arrival_key(req)

    def rank_sorted(self, running, waiting, now):
        running = by_admission(running)
        decodes = [r for r in running if r.num_uncomputed_tokens <= 1]
        prefills = [r for r in running if r.num_uncomputed_tokens > 1]
        return running_first(decodes + prefills, waiting.requests)


class ThreeLevelPolicy(Policy):
    """Three levels: new prompts first (chunked), then running sequences FCFS; a sequence that has decoded more
    than `demote_after` tokens drops into a preemptible pool, ranked last and preempted first under memory
    pressure, also by new prompts (for pages, or for a slot unless `preempt_for_slot` is False). Short requests
    pass long ones; long ones still finish once the pressure goes."""

    name = "three_level"

    def __init__(
        self,
        demote_after: int = 64,
        victim: str = "rank",
        reserve_to_completion: bool | None = None,
        preempt_for_slot: bool = True,
    ):
        super().__init__(victim, reserve_to_completion)
        self.demote_after = check.integer("three_level demote_after", demote_after, 0)
        self.preempt_for_slot = check.boolean("three_level preempt_for_slot", preempt_for_slot)

    def demoted(self, req: Request) -> bool:
        return len(req.output_token_ids) > self.demote_after

    def waiting_key(self, req):
        return arrival_key(req)

    def rank_sorted(self, running, waiting, now):
        running = by_admission(running)
        kept = [r for r in running if not self.demoted(r)]
        return waiting_first(kept + [r for r in running if self.demoted(r)], waiting.requests)

    def victims(self, requester, lower):
        if requester.status is RequestStatus.RUNNING:
            return lower
        # Only a new prompt may push out a demoted sequence; a resumed one waits (no ping-pong between long ones).
        return [r for r in lower if self.demoted(r)] if not requester.output_token_ids else []


class SJFPolicy(LengthAwarePolicy):
    """Shortest job first: running sequences keep going (non-preemptive); waiting requests are admitted smallest
    job first, ties by arrival. The job is the prompt length, plus the predicted output length with a
    `length_predictor` (length_aware.py). Long jobs can starve under sustained load."""

    name = "sjf"

    def __init__(
        self,
        length_predictor: str | None = None,
        sigma: float | None = None,
        predictor_seed: int = 0,
        prior_tokens: int | None = None,
        victim: str = "rank",
        reserve_to_completion: bool | None = None,
    ):
        super().__init__(length_predictor, sigma, predictor_seed, prior_tokens, victim, reserve_to_completion)

    def job_tokens(self, req: Request) -> int:
        if self.predictor is None:
            return req.num_prompt_tokens
        return req.num_prompt_tokens + self.predicted_output_tokens(req)

    def waiting_key(self, req):
        return (self.job_tokens(req), req.arrival_order)

    def rank_sorted(self, running, waiting, now):
        return running_first(by_admission(running), waiting.requests)


class SRPTOraclePolicy(LengthAwarePolicy):
    """Shortest remaining processing time, clairvoyant: it knows each request's output length (`max_tokens`,
    exact when EOS is ignored, as in the experiment workloads) and ranks every request by the tokens it still
    has to compute and generate. Preemptive: a shorter newcomer may push out a longer running sequence. A bound
    to compare real policies against, not a deployable policy; with a noisy or learned `length_predictor`
    (length_aware.py) it is SRPT on predicted lengths, which is deployable."""

    name = "srpt_oracle"
    preempts_for_admission = True

    def __init__(
        self,
        length_predictor: str = "oracle",
        sigma: float | None = None,
        predictor_seed: int = 0,
        prior_tokens: int | None = None,
        victim: str = "rank",
        reserve_to_completion: bool | None = None,
        preempt_for_slot: bool = True,
    ):
        super().__init__(length_predictor, sigma, predictor_seed, prior_tokens, victim, reserve_to_completion)
        self.preempt_for_slot = check.boolean("srpt_oracle preempt_for_slot", preempt_for_slot)

    def remaining(self, req: Request) -> int:
        prompt_left = max(0, req.num_prompt_tokens - req.num_computed_tokens)
        return prompt_left + self.predicted_remaining_output(req)

    def waiting_key(self, req):
        # Fixed while it waits: a waiting request computes and generates nothing.
        return (self.remaining(req), req.arrival_order)

    def rank_sorted(self, running, waiting, now):
        return merge_by_key(running, waiting, self.waiting_key)


class FairSharePolicy(Policy):
    """Per-tenant fair share by virtual token counters (VTC, Sheng et al. 2024). Each tenant's counter grows by the
    service it gets: `input_weight` per prompt token computed and `output_weight` per generated token, divided by
    the tenant's weight (`tenant_weights`, default 1). Waiting requests are admitted from the tenant with the
    smallest counter (FCFS within a tenant); a tenant that comes back after being idle is lifted to the smallest
    active counter, so idleness banks no credit. Running sequences keep going (non-preemptive)."""

    name = "fair_share"

    def __init__(
        self,
        input_weight: float = 1.0,
        output_weight: float = 2.0,
        tenant_weights: dict | None = None,
        victim: str = "rank",
        reserve_to_completion: bool | None = None,
    ):
        super().__init__(victim, reserve_to_completion)
        self.input_weight = check.real("fair_share input_weight", input_weight, 0.0)
        self.output_weight = check.real("fair_share output_weight", output_weight, 0.0)
        self.tenant_weights = {
            tenant: check.real(f"fair_share tenant_weights[{tenant!r}]", w, 0.0, low_open=True)
            for tenant, w in check.mapping("fair_share tenant_weights", tenant_weights).items()
        }
        self.counters: dict[str, float] = {}

    def weight(self, tenant: str) -> float:
        """The tenant's share weight (tenant_weights; 1 when not given)."""
        return self.tenant_weights.get(tenant, 1.0)

    def on_arrival(self, req, now):
        view = self.view
        active = {r.tenant for r in (*view.running, *view.waiting)} if view is not None else set()
        if req.tenant not in active:
            floor = min((self.counters.get(t, 0.0) for t in active), default=0.0)
            self.counters[req.tenant] = max(self.counters.get(req.tenant, 0.0), floor)

    def on_scheduled(self, req, num_tokens, now):
        # A chunk that reaches the end of the context samples one token: charge the output weight for it.
        prompt_part = max(0, min(num_tokens, req.num_prompt_tokens - req.num_computed_tokens))
        cost = prompt_part * self.input_weight
        if req.num_computed_tokens + num_tokens == req.num_tokens:
            cost += self.output_weight
        self.counters[req.tenant] = self.counters.get(req.tenant, 0.0) + cost / self.weight(req.tenant)

    def waiting_key(self, req):
        return (req.tenant, req.arrival_order)  # each tenant's queue in arrival order, one run after another

    def rank_sorted(self, running, waiting, now):
        reqs, keys = waiting
        heap, i = [], 0
        while i < len(reqs):  # one entry per tenant: its counter now and the head of its run
            tenant = keys[i][0][0]
            end = bisect_left(keys, ((tenant, math.inf),), i)
            heap.append((self.counters.get(tenant, 0.0), reqs[i].arrival_order, tenant, i, end))
            i = end
        heapq.heapify(heap)
        return running_first(by_admission(running), _interleaved(self, reqs, heap))


def _interleaved(policy: FairSharePolicy, reqs: list[Request], heap: list) -> Iterator[Request]:
    """fair_share's waiting order, lazily: the tenants' runs of the sorted queue merged by counter, each pick
    charging its prompt. `heap` holds the counters read when the step was ranked, as `rank` reads them."""
    while heap:
        c, _, t, pos, end = heapq.heappop(heap)
        r = reqs[pos]
        yield r
        pos += 1
        if pos < end:
            c += r.num_prompt_tokens * policy.input_weight / policy.weight(t)
            heapq.heappush(heap, (c, reqs[pos].arrival_order, t, pos, end))


class EDFPolicy(Policy):
    """Earliest deadline first over every request. A request's deadline is its own (`deadline`, absolute), else
    arrival + the slack of its SLO class (`class_slack_s[priority]`), else arrival + `default_slack_s`.
    Preemptive: an earlier deadline may push out a later one when pages or slots run out (`preempt_for_slot`
    False: pages only)."""

    name = "edf"
    preempts_for_admission = True

    def __init__(
        self,
        default_slack_s: float = 30.0,
        class_slack_s: dict | None = None,
        victim: str = "rank",
        reserve_to_completion: bool | None = None,
        preempt_for_slot: bool = True,
    ):
        super().__init__(victim, reserve_to_completion)
        self.default_slack_s = check.real("edf default_slack_s", default_slack_s)
        self.preempt_for_slot = check.boolean("edf preempt_for_slot", preempt_for_slot)
        if class_slack_s is not None and not isinstance(class_slack_s, Mapping):
            raise ValueError(f"edf class_slack_s must be a dict priority -> seconds, got {class_slack_s!r}")
        # Keys may arrive as strings (config files, JSON): "1" is priority 1.
        self.class_slack_s = {
            _priority_key(k): check.real(f"edf class_slack_s[{k!r}]", v) for k, v in (class_slack_s or {}).items()
        }

    def deadline(self, req: Request) -> float:
        if req.deadline is not None:
            return req.deadline
        return req.metrics.arrival_time + self.class_slack_s.get(req.priority, self.default_slack_s)

    def waiting_key(self, req):
        return (self.deadline(req), req.arrival_order)

    def rank_sorted(self, running, waiting, now):
        return merge_by_key(running, waiting, self.waiting_key)


def _priority_key(key) -> int:
    if isinstance(key, str) and key.lstrip("-").isdigit():
        return int(key)
    return check.integer("edf class_slack_s key (a priority)", key)


class LPMPolicy(Policy):
    """Longest prefix match first (SGLang's cache-aware order): waiting requests whose prompt has the most tokens in
    the prefix cache go first, so shared prefixes are reused before they are evicted. Aging: every second of
    waiting counts as `aging_tokens_per_s` matched tokens, so unmatched requests are not starved. Needs
    enable_prefix_caching to differ from FCFS."""

    name = "lpm"

    def __init__(
        self, aging_tokens_per_s: float = 256.0, victim: str = "rank", reserve_to_completion: bool | None = None
    ):
        super().__init__(victim, reserve_to_completion)
        self.aging_tokens_per_s = check.real("lpm aging_tokens_per_s", aging_tokens_per_s, 0.0)

    def rank(self, running, waiting, now):
        view = self.view
        if view is None or not view.prefix_caching:
            return fcfs_order(running, waiting)

        def score(r: Request) -> float:
            waited = now - r.metrics.arrival_time
            return view.cached_prefix_tokens(r) + self.aging_tokens_per_s * waited

        return by_admission(running) + sorted(waiting, key=lambda r: (-score(r), r.arrival_order))

    # The fast path. A request's score is at most its context length - 1 (the most the cache can hold of it) plus
    # its aging, so the queue is kept in the order of that bound: a step scores requests in that order only until
    # the best scored one beats every bound left. It scores at ranking time (admissions during the walk evict cached
    # pages) the most the walk can visit: max_num_seqs + 1 requests, plus any preempted ones with a pending token
    # (the walk may skip those); the rest is scored only if read.
    def waiting_key(self, req):
        bound = (len(req.all_token_ids) - 1) - self.aging_tokens_per_s * req.metrics.arrival_time
        return (-bound, req.arrival_order)

    def rank_sorted(self, running, waiting, now):
        view = self.view
        if view is None or not view.prefix_caching:
            return running_first(by_admission(running), by_arrival_of(waiting))
        return running_first(by_admission(running), self._by_score(waiting, now))

    def _score(self, req: Request, now: float) -> float:
        return self.view.cached_prefix_tokens(req) + self.aging_tokens_per_s * (now - req.metrics.arrival_time)

    def _by_score(self, waiting, now: float) -> Iterator[Request]:
        reqs, keys = waiting
        aging = self.aging_tokens_per_s
        wanted = len(reqs) if self.view is None else self.view.max_num_seqs + 1
        first, scored, i = [], [], 0  # scored: a heap of (-score, arrival_order, seq, request)
        cached = None if self.view is None else self.view.cached_prefix_tokens  # (_score, inline below)
        while len(first) < wanted and (i < len(reqs) or scored):
            while i < len(reqs):
                r = reqs[i]
                bound = (len(r.all_token_ids) - 1) + aging * (now - r.metrics.arrival_time)
                # The queue's order is the bounds' up to rounding: the margin covers it.
                if scored and -scored[0][0] > bound + 1e-6 + 1e-9 * abs(bound):
                    break
                score = cached(r) + aging * (now - r.metrics.arrival_time)  # _score(r, now), one call fewer per request
                heapq.heappush(scored, (-score, r.arrival_order, keys[i][1], r))
                i += 1
            r = heapq.heappop(scored)[3]
            first.append(r)
            if r.num_pending_tokens:
                wanted += 1
        return itertools.chain(first, self._rest(scored, reqs[i:], keys[i:], now))

    def _rest(self, scored: list, reqs: list[Request], keys: list[tuple], now: float) -> Iterator[Request]:
        rest = scored + [(-self._score(r, now), r.arrival_order, k[1], r) for r, k in zip(reqs, keys)]
        rest.sort(key=lambda e: e[:3])
        for e in rest:
            yield e[3]


POLICIES: dict[str, type[Policy]] = {
    cls.name: cls
    for cls in (
        FCFSPolicy,
        StaticPolicy,
        PrefillFirstPolicy,
        SarathiPolicy,
        PriorityPolicy,
        ThreeLevelPolicy,
        SJFPolicy,
        SRPTOraclePolicy,
        MLFQPolicy,
        FairSharePolicy,
        EDFPolicy,
        LPMPolicy,
        ResidualSJFPolicy,
        HRRNPolicy,
        SLOAwarePolicy,
    )
}


def make_policy(name: str, options: dict | None = None, **context) -> Policy:
    """Build a policy by name. `options` are the user's (EngineConfig.policy_options): an option the policy does
    not take is an error. `context` (batch_timeout_s, ...) is offered to every policy and passed to
    those whose constructor takes it."""
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; known: {sorted(POLICIES)}")
    cls = POLICIES[name]
    accepted = inspect.signature(cls.__init__).parameters
    options = dict(options or {})
    unknown = sorted(set(options) - set(accepted) - {"self"})
    if unknown:
        known = sorted(set(accepted) - {"self"})
        raise ValueError(f"policy {name!r} takes no option(s) {unknown}; its options: {known}")
    kwargs = {k: v for k, v in context.items() if k in accepted}
    kwargs.update(options)
    return cls(**kwargs)
