"""The fast path's building blocks (cbjax.core.policy): a step's ranking made from the scheduler's sorted waiting
queue instead of a sort of the whole queue, lazily, so the scheduler's walk can stop early."""

import itertools
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

from cbjax.core.request import Request


class SortedWaiting(NamedTuple):
    """The waiting requests sorted by the policy's `waiting_key`, ties in joining order; `keys[i]` is
    `(waiting_key(requests[i]), seq)`. A snapshot: it does not change while the scheduler walks the ranking."""

    requests: list[Request]
    keys: list[tuple]

    @classmethod
    def of(cls, waiting: Iterable[Request], key: Callable[[Request], Any]) -> "SortedWaiting":
        """Sort `waiting` (in joining order) by `key`, as the scheduler's queue would hold it."""
        keyed = sorted(((key(r), seq), r) for seq, r in enumerate(waiting))
        return cls([r for _, r in keyed], [k for k, _ in keyed])


class Ranking(NamedTuple):
    """A step's order (`order`, possibly lazy) and the running requests in that same order (`running`)."""

    order: Iterable[Request]
    running: list[Request]


def merge_by_key(running: Iterable[Request], waiting: SortedWaiting, key: Callable[[Request], Any]) -> Ranking:
    """The order of a stable `sorted([*running, *waiting], key=key)`, lazily, for `waiting` already sorted by the
    same key: a running request goes before waiting ones of an equal key, as in the stable sort."""
    ranked = sorted(running, key=key)
    return Ranking(_merged(ranked, [key(r) for r in ranked], waiting), ranked)


def _merged(ranked: list[Request], keys: list, waiting: SortedWaiting) -> Iterator[Request]:
    reqs, wkeys = waiting
    i = 0
    for k, r in zip(keys, ranked):
        j = bisect_left(wkeys, (k,), i)  # (k,) sorts before every (k, seq): the first waiting key >= k
        for t in range(i, j):
            yield reqs[t]
        yield r
        i = j
    for t in range(i, len(reqs)):
        yield reqs[t]


def arrival_key(req: Request) -> tuple:
    """Arrival order: the waiting_key of the policies that admit in arrival order."""
    return (req.arrival_order,)


def running_first(running: list[Request], waiting: Iterable[Request]) -> Ranking:
    """The running requests (in the order given), then the waiting ones."""
    return Ranking(itertools.chain(running, waiting), running)


def waiting_first(running: list[Request], waiting: Iterable[Request]) -> Ranking:
    """The waiting requests, then the running ones (in the order given)."""
    return Ranking(itertools.chain(waiting, running), running)


def by_arrival_of(waiting) -> list[Request]:
    """The waiting requests of a SortedWaiting in arrival order (ties in joining order)."""
    return [r for _, r in sorted(((r.arrival_order, k[1]), r) for r, k in zip(*waiting))]


def visits(ranking: Ranking, step) -> Iterator[tuple[Request, int]]:
    """The requests of the ranking a scheduler step must look at, in order, each with where the running requests
    ranked below it start in `ranking.running`. Once no more waiting requests may join the step (`step.may_admit`,
    which only ever turns off), every waiting request after that is skipped: the walk jumps to the running ones
    left instead of stepping through a long queue."""
    running = ranking.running
    i = 0
    for req in ranking.order:
        if i < len(running) and running[i] is req:
            i += 1
        elif not step.may_admit:
            break
        yield req, i
    else:
        return
    for j in range(i, len(running)):
        yield running[j], j + 1
