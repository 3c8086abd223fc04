"""The policy interface: the decisions a Scheduler delegates, each behind its own hook.

The Scheduler does the bookkeeping (token budget, slots, pages, swaps, state changes). A policy answers:

  rank(running, waiting, now)     the step's order: every request, most important first. The scheduler walks it,
                                  giving each its next chunk while the token budget and the slots last, so the
                                  order also decides "decodes first or prefills first".
  chunked_prefill, chunk_size     may a prompt that fits one step be split; the most tokens a sequence gets a step.
  reserve_to_completion           admission reserves pages for prompt + max_tokens (never preempts later) instead
                                  of admitting optimistically.
  may_admit(running, waiting, now)  may waiting requests join now at all (static batching says no mid-batch).
  victims(requester, lower)       which running requests ranked below `requester` it may preempt for pages or a
                                  slot (default: a running sequence may preempt any of them, a waiting one none).
                                  `preempt_for_slot` False: a waiting one never preempts for a slot.
  choose_victim(candidates, now)  which one goes first (the `victim` option: rank, last_admitted,
                                  lowest_priority, longest_running, cheapest_recompute).
  choose_eviction(pages)          which released prefix-cache page to overwrite (None = least recently used).
  on_scheduled / on_arrival       accounting for stateful policies (mlfq levels, fair-share counters).
  on_finish(req, now)             a request finished (any reason, aborts too): what it generated is known
                                  (the learned length predictor, cbjax/core/length_predictor.py, fits on it).
  next_event_time(running, waiting)  when the policy will admit although nothing changes (a static timeout);
                                  the online loop sleeps until then.

A fast path for long queues (optional; every built-in policy takes it, a custom policy need not):

  waiting_key(req)                a sort key of a waiting request, fixed while it waits. With one, the scheduler
                                  keeps its waiting queue in this order (ties in the order they joined the queue)
                                  and calls `rank_sorted` instead of `rank`.
  rank_sorted(running, waiting, now)  the same order as `rank`, given the waiting requests already sorted
                                  (`SortedWaiting`); returns a `Ranking`: the order (may be lazy: the scheduler
                                  stops early) and the running requests in that order.
  stale_waiting_keys(now)         waiting requests whose key the policy changed since they queued (mlfq's
                                  starvation reset); the scheduler re-sorts them before `rank_sorted`.

A policy reads the scheduler's state through `self.view`, a read-only `SchedulerView` the Scheduler attaches
when it is built: the queues and the prefix cache's contents, never the means to change them.

A new policy is a small subclass that implements `rank` (and perhaps `victims`): see docs/policies.md. The zoo is
in policy_zoo.py; register a policy in `POLICIES` there to make it reachable by name from EngineConfig.policy,
`LLM(policy=...)` and the experiment configs. Priorities follow vLLM: a lower `priority` value is more important.
"""

import operator
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

from cbjax.config import validation as check
from cbjax.core.request import Request, RequestStatus
from cbjax.core.sorted_ranking import Ranking, SortedWaiting, merge_by_key  # noqa: F401  (part of the interface)


def by_admission(reqs: Iterable[Request]) -> list[Request]:
    """Running requests in the order they were admitted (a building block for `rank`)."""
    return sorted(reqs, key=_ADMISSION_ORDER)  # (every step: a key read in C, not a lambda per request)


def by_arrival(reqs: Iterable[Request]) -> list[Request]:
    """Requests in arrival order (a building block for `rank`)."""
    return sorted(reqs, key=_ARRIVAL_ORDER)


_ADMISSION_ORDER, _ARRIVAL_ORDER = operator.attrgetter("admission_order"), operator.attrgetter("arrival_order")


def fcfs_order(running: Iterable[Request], waiting: Iterable[Request]) -> list[Request]:
    """Running requests in admission order, then waiting ones in arrival order (continuous FCFS)."""
    return by_admission(running) + by_arrival(waiting)


# ---- victim choice: among the running requests a requester may preempt, which goes first -----------------------
def _victim_rank(cands: Sequence[Request], now: float) -> Request:
    return cands[-1]  # candidates come in rank order: the least important


VICTIMS = {
    "rank": _victim_rank,
    "last_admitted": lambda cands, now: max(cands, key=lambda r: r.admission_order),
    "lowest_priority": lambda cands, now: max(cands, key=lambda r: (r.priority, r.admission_order)),
    # The one that has decoded longest: it holds the most pages, so one preemption frees the most.
    "longest_running": lambda cands, now: max(cands, key=lambda r: (len(r.output_token_ids), r.admission_order)),
    # The least KV to rebuild (or to move, under swap).
    "cheapest_recompute": lambda cands, now: min(cands, key=lambda r: (r.num_computed_tokens, -r.admission_order)),
}


class SchedulerView(Protocol):
    """What a policy may read of its Scheduler (cbjax.core.scheduler.ReadOnlyScheduler implements it)."""

    @property
    def running(self) -> Sequence[Request]: ...

    @property
    def waiting(self) -> Sequence[Request]: ...

    @property
    def prefix_caching(self) -> bool: ...

    @property
    def max_num_seqs(self) -> int: ...

    def cached_prefix_tokens(self, req: Request) -> int:
        """Tokens of the request's context a fresh admission would find in the prefix cache."""
        ...


class Policy:
    """The base of every policy: the hooks' defaults. `rank` has none; `FCFSPolicy` is continuous FCFS."""

    name: str = ""  # the registry name (POLICIES); empty for abstract bases
    # Admission moves a whole batch (up to max_num_seqs) into the running set at once (static batching).
    admits_whole_batch = False
    chunked_prefill: bool | None = None  # None: the engine's enable_chunked_prefill; False: whole prompts only
    chunk_size: int | None = None  # most tokens one sequence computes in a step (None: the step's budget)
    reserve_to_completion = False
    # A waiting request may preempt lower-ranked running ones (for pages or for a slot).
    preempts_for_admission = False
    # When every slot is taken (pages free or not), a waiting request may preempt for a slot, as `victims` allows;
    # False: it waits for a slot to free. The `preempt_for_slot` option of the policies whose waiting requests
    # preempt (priority, edf, srpt_oracle, mlfq, three_level; on by default); page preemption is unaffected.
    preempt_for_slot = True
    # The fast path (see the module docstring): a method `waiting_key(req)`, or None for `rank` every step.
    waiting_key: Callable[[Request], Any] | None = None

    def __init__(self, victim: str = "rank", reserve_to_completion: bool | None = None):
        self.victim = check.choice("victim", victim, VICTIMS)
        self._choose = VICTIMS[victim]
        if reserve_to_completion is not None:
            self.reserve_to_completion = check.boolean("reserve_to_completion", reserve_to_completion)
        self.view: SchedulerView | None = None  # attached by the Scheduler

    def attach(self, view: SchedulerView) -> None:
        self.view = view

    # ---- hooks ------------------------------------------------------------------------------------------------
    def rank(self, running: Sequence[Request], waiting: Sequence[Request], now: float) -> list[Request]:
        if self.waiting_key is None:
            raise NotImplementedError(f"{type(self).__name__} must implement rank()")
        return list(self.rank_sorted(running, SortedWaiting.of(waiting, self.waiting_key), now).order)

    def rank_sorted(self, running: Sequence[Request], waiting: SortedWaiting, now: float) -> Ranking:
        """`rank` with the waiting requests already sorted by `waiting_key` (only called when there is one)."""
        raise NotImplementedError(f"{type(self).__name__} has a waiting_key but no rank_sorted()")

    def stale_waiting_keys(self, now: float) -> Iterable[Request]:
        return ()

    def may_admit(self, running: Sequence[Request], waiting: Sequence[Request], now: float) -> bool:
        return True

    def victims(self, requester: Request, lower: list[Request]) -> list[Request]:
        """`lower`: the running requests ranked below `requester` and not yet scheduled this step, in rank order."""
        if requester.status is RequestStatus.RUNNING or self.preempts_for_admission:
            return lower
        return []

    def choose_victim(self, candidates: Sequence[Request], now: float) -> Request:
        return self._choose(candidates, now)

    def choose_eviction(self, evictable: Iterable[int]) -> int | None:
        return None  # least recently released first (the pool's own order)

    def on_arrival(self, req: Request, now: float) -> None:
        pass

    def on_scheduled(self, req: Request, num_tokens: int, now: float) -> None:
        pass

    def on_finish(self, req: Request, now: float) -> None:
        pass

    def next_event_time(self, running: Sequence[Request], waiting: Sequence[Request]) -> float | None:
        return None


def scheduled_hook(policy) -> Callable[[Request, int, float], None] | None:
    """`policy.on_scheduled`, or None where it is the base class's, which does nothing: the scheduler's loops skip
    the call (once per scheduled token), and a block of decode steps may end early (it charged nothing per step)."""
    hook = policy.on_scheduled
    return None if getattr(hook, "__func__", None) is Policy.on_scheduled else hook
