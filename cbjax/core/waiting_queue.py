"""The scheduler's queue of waiting requests (new and preempted), kept in the policy's order when it has one.

A policy that declares `waiting_key` (cbjax.core.policy) gets its waiting requests already sorted: the queue keeps
them in `(waiting_key(req), seq)` order as they come and go, with `seq` the order they joined the queue. That is
exactly a stable sort of the queue in joining order, which is what a policy's `rank` did every step, so the order is
the same, but a step costs O(log n) per arrival or admission instead of a sort of thousands. Without a key the queue
is the plain list in joining order, as before.
"""

from bisect import bisect_left, bisect_right
from collections.abc import Callable, Iterator
from typing import Any

from cbjax.core.request import Request


class WaitingQueue:
    """Waiting requests, in joining order or sorted by `key` (fixed while a request waits; `rekey` when the
    policy changes it). Iterates in that order; `remove` and membership are by identity."""

    __slots__ = ("_added", "_gone", "_key", "_keys", "_lent", "_requests", "_seq", "_slot")

    def __init__(self, key: Callable[[Request], Any] | None = None):
        self._key = key
        self._requests: list[Request] = []
        self._keys: list[tuple] = []  # parallel to _requests when sorted: (key, seq)
        self._slot: dict[int, tuple] = {}  # id(request) -> its (key, seq); seq alone when unsorted
        self._seq = 0
        self._lent = False  # a snapshot of the lists is out: they must not change under its reader
        # Changes while a snapshot is out (admissions and preemptions during the scheduler's walk) are held back
        # and made in place once it is released: copying the lists instead cost a pass over the whole queue.
        self._gone: list[tuple[Request, tuple]] = []  # removed, still in the lists
        self._added: list[tuple[Request, tuple]] = []  # joined, not in the lists yet

    @property
    def sorted(self) -> bool:
        return self._key is not None

    @property
    def requests(self) -> list[Request]:
        """The requests in queue order: read it, do not change it."""
        if self._gone or self._added:
            self._own()
        return self._requests

    def snapshot(self) -> tuple[list[Request], list[tuple]]:
        """(requests, keys) as they are now, unaffected by later changes to the queue until `release`."""
        if self._gone or self._added:
            self._own()
        self._lent = True
        return self._requests, self._keys

    def release(self) -> None:
        """The snapshot lent last is read no more (the scheduler's walk is over): the changes held back meanwhile
        are made, and later ones in place."""
        self._lent = False
        self._own()

    def __len__(self) -> int:
        return len(self._requests) - len(self._gone) + len(self._added)

    def __bool__(self) -> bool:
        return len(self) > 0

    def __iter__(self) -> Iterator[Request]:
        return iter(self.requests)

    def __contains__(self, req: Request) -> bool:
        return id(req) in self._slot

    def _own(self) -> None:
        """Make the lists safe to change (copied if a snapshot is out), then make the changes held back."""
        if self._lent:
            self._requests = list(self._requests)
            self._keys = list(self._keys)
            self._lent = False
        if self._gone or self._added:
            # The queue's order is its slots' (or joining) order, whatever the order the changes are made in.
            gone, added, self._gone, self._added = self._gone, self._added, [], []
            for req, slot in gone:
                self._delete(req, slot)
            for req, slot in added:
                self._place(req, slot)

    def append(self, req: Request) -> None:
        self._seq += 1
        slot = (self._seq,) if self._key is None else (self._key(req), self._seq)
        self._slot[id(req)] = slot
        if self._lent:
            self._added.append((req, slot))  # the snapshot's reader may be walking the lists: later, in place
        else:
            self._place(req, slot)

    def _place(self, req: Request, slot: tuple) -> None:
        if self._key is None:
            self._requests.append(req)
        else:
            i = bisect_right(self._keys, slot)
            self._keys.insert(i, slot)
            self._requests.insert(i, req)

    def remove(self, req: Request) -> None:
        slot = self._slot.pop(id(req), None)
        if slot is None:
            raise ValueError(f"{req!r} is not waiting")
        if not self._lent:
            self._delete(req, slot)
        elif any(r is req for r, _ in self._added):
            self._added = [(r, s) for r, s in self._added if r is not req]
        else:
            self._gone.append((req, slot))

    def _delete(self, req: Request, slot: tuple) -> None:
        if self._key is None:
            self._requests.remove(req)
        else:
            i = bisect_left(self._keys, slot)
            del self._keys[i]
            del self._requests[i]

    def rekey(self, req: Request) -> None:
        """The policy changed `req`'s key while it waits (mlfq's starvation reset): move it, keeping its seq."""
        old = self._slot[id(req)]
        new = (self._key(req), old[1])
        if new != old:
            self.remove(req)
            self._own()
            self._slot[id(req)] = new
            self._place(req, new)
