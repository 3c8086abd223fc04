"""The KV page pool: fixed-size pages handed out from a free list and recycled by refcount."""
import collections


class PagePool:
    """Physical page ids 0..num_pages-1 with refcounts.

    A page is free when its refcount is 0. `allocate` hands out fresh pages (refcount 1); `free` drops one
    reference per page and returns pages whose count reaches 0 to the free list. Refcounts above 1 are for pages
    shared between sequences (prefix caching); the plain engine uses 0 and 1 only.
    """

    def __init__(self, num_pages: int):
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        self.num_pages = num_pages
        self._refcounts = [0] * num_pages
        # FIFO reuse spreads writes across the pool, which makes stale-data bugs show up in tests sooner.
        self._free = collections.deque(range(num_pages))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"out of KV pages: asked for {n}, {len(self._free)} free")
        pages = [self._free.popleft() for _ in range(n)]
        for p in pages:
            self._refcounts[p] = 1
        return pages

    def incref(self, pages: list[int]) -> None:
        for p in pages:
            if self._refcounts[p] <= 0:
                raise RuntimeError(f"incref of free page {p}")
            self._refcounts[p] += 1

    def free(self, pages: list[int]) -> None:
        for p in pages:
            rc = self._refcounts[p] - 1
            if rc < 0:
                raise RuntimeError(f"page {p} freed more often than allocated")
            self._refcounts[p] = rc
            if rc == 0:
                self._free.append(p)

    def refcount(self, page: int) -> int:
        return self._refcounts[page]

    def check_consistent(self) -> None:
        """Raise if the free list and refcounts disagree (a test and debugging aid)."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("a page is on the free list twice")
        for p, rc in enumerate(self._refcounts):
            if rc < 0:
                raise AssertionError(f"page {p} has negative refcount {rc}")
            if (rc == 0) != (p in free):
                raise AssertionError(f"page {p}: refcount {rc} but on free list: {p in free}")
