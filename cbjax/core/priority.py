"""The strict-priority policy with aging, and its fast path over the queue sorted by class."""

import heapq
import math
from bisect import bisect_left
from collections.abc import Iterator

from cbjax.config import validation as check
from cbjax.core.policy import Policy
from cbjax.core.request import Request
from cbjax.core.sorted_ranking import Ranking, merge_by_key


class PriorityPolicy(Policy):
    """Strict priority classes (lower value first), FCFS within a class, with aging: a request's effective
    priority improves by one level for every `aging_s` seconds since its arrival, so old low-priority requests
    eventually outrank new high-priority ones (no starvation). A waiting request may preempt lower-ranked running
    ones when pages or slots run out; the least important goes first. With `preempt_for_slot` False it preempts
    only for pages: when the slots are full it waits for one to free."""

    name = "priority"
    preempts_for_admission = True

    def __init__(
        self,
        aging_s: float | None = 10.0,
        victim: str = "rank",
        reserve_to_completion: bool | None = None,
        preempt_for_slot: bool = True,
    ):
        super().__init__(victim, reserve_to_completion)
        self.aging_s = check.optional_real("priority aging_s (None: no aging)", aging_s, 0.0, low_open=True)
        self.preempt_for_slot = check.boolean("priority preempt_for_slot", preempt_for_slot)

    def effective_priority(self, req: Request, now: float) -> float:
        if self.aging_s is None:
            return req.priority
        return req.priority - (now - req.metrics.arrival_time) / self.aging_s

    def rank(self, running, waiting, now):
        # Aging shifts every request by the same amount per second, so two requests never swap places over time:
        # only newcomers are outranked by old requests. Ties (and equal classes) go to the earlier arrival.
        return sorted([*running, *waiting], key=lambda r: (self.effective_priority(r, now), r.arrival_order))

    # The fast path: the queue by class, then arrival time. Within a class the effective priority only grows with
    # the arrival time, so each class's run is already in order but for requests whose effective priorities come
    # out equal (the same arrival time, or rounding): those go by arrival order, as in `rank`. The classes' runs and
    # the running requests are merged lazily by (effective priority, arrival order), running first on a tie.
    def waiting_key(self, req):
        if self.aging_s is None:
            return (req.priority, req.arrival_order)
        return (req.priority, req.metrics.arrival_time, req.arrival_order)

    def rank_sorted(self, running, waiting, now):
        if self.aging_s is None:
            return merge_by_key(running, waiting, self.waiting_key)
        ranked = sorted(running, key=lambda r: (self.effective_priority(r, now), r.arrival_order))
        streams = [[((self.effective_priority(r, now), r.arrival_order, 0, i), r) for i, r in enumerate(ranked)]]
        reqs, keys = waiting
        i = 0
        while i < len(reqs):
            end = bisect_left(keys, ((keys[i][0][0], math.inf),), i)  # the end of this class's run
            streams.append(self._class_order(reqs, keys, i, end, now))
            i = end
        return Ranking((r for _, r in heapq.merge(*streams)), ranked)

    def _class_order(self, reqs: list[Request], keys: list[tuple], i: int, end: int, now: float) -> Iterator:
        """((effective priority, arrival order, 1, seq), request) of reqs[i:end], one class, in rank order."""
        eff = self.effective_priority
        while i < end:
            e = eff(reqs[i], now)
            blocks, j = [], i
            while j < end and eff(reqs[j], now) == e:  # blocks of one arrival time each, all of priority e
                p, a, _ = keys[j][0]
                k = bisect_left(keys, ((p, a, math.inf),), j, end)
                blocks.append(_keyed_block(reqs, keys, e, j, k))
                j = k
            yield from blocks[0] if len(blocks) == 1 else heapq.merge(*blocks)
            i = j


def _keyed_block(reqs: list[Request], keys: list[tuple], e: float, start: int, end: int) -> Iterator:
    """priority's merge entries of reqs[start:end] (one arrival time: already in arrival order), lazily."""
    for t in range(start, end):
        yield ((e, reqs[t].arrival_order, 1, keys[t][1]), reqs[t])
