"""The KV page pool: fixed-size pages handed out from a free list and recycled by refcount, with an optional
prefix cache (full pages keyed by a chained hash, shared by refcount, kept after release in an LRU until evicted).
"""

import collections
from collections.abc import Sequence

# The hash chain's seed: the parent hash of a sequence's first page.
ROOT_HASH = 0x9E3779B97F4A7C15


def chain_hashes(tokens: Sequence[int], page_size: int, hashes: list[int], upto: int | None = None) -> list[int]:
    """Extend `hashes` (one per full page, each chained over its parent's) to cover the full pages of
    `tokens[:upto]`; returns `hashes`. A page's hash names its tokens *and* every token before it, so equal hashes
    mean equal KV (the same model, the same positions). Python's tuple hash is fine within one process."""
    n = len(tokens) if upto is None else upto
    parent = hashes[-1] if hashes else ROOT_HASH
    for start in range(len(hashes) * page_size, n - page_size + 1, page_size):
        parent = hash((parent, tuple(tokens[start : start + page_size])))
        hashes.append(parent)
    return hashes


class PagePool:
    """Physical page ids 0..num_pages-1 with refcounts.

    A page is in use while its refcount is above 0. `allocate` hands out fresh pages (refcount 1); `free` drops one
    reference per page. With `enable_caching`, a page whose content was registered under a hash (`register`) stays
    findable by `lookup` after its last reference is dropped: it waits in an LRU queue of evictable pages and is
    reused by a later hit (`incref` revives it) or, least recently released first, by `allocate` when the free
    list is empty. Free and evictable pages both count as available (`num_free`). With a `host_tier`
    (core/host_prefix_cache.py) an evicted cached page is offered to it (`host_tier.spill(page, hash)`) first.
    """

    def __init__(self, num_pages: int, enable_caching: bool = False, host_tier=None):
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        self.num_pages = num_pages
        self.enable_caching = enable_caching
        if host_tier is not None and not enable_caching:
            raise ValueError("a host tier of the prefix cache needs enable_caching=True")
        self.host_tier = host_tier
        self._refcounts = [0] * num_pages
        # FIFO reuse spreads writes across the pool, which makes stale-data bugs show up in tests sooner.
        self._free = collections.deque(range(num_pages))
        self._page_of_hash: dict[int, int] = {}
        self._hash_of_page: dict[int, int] = {}
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()  # LRU first
        self.num_evictions = 0
        # Prefix-cache statistics in tokens, as vLLM reports them: hit rate = hit / queried (hits in either tier: the
        # scheduler records the host tier's too, which also counts its own).
        self.queried_tokens = 0
        self.hit_tokens = 0

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_pages - self.num_free

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def allocate(self, n: int, choose_eviction=None) -> list[int]:
        """`n` pages with refcount 1: free ones first, then evicted cached ones, least recently released first
        unless `choose_eviction(evictable pages in LRU order)` names another (None: LRU)."""
        if n > self.num_free:
            raise RuntimeError(f"out of KV pages: asked for {n}, {self.num_free} free")
        pages = []
        for _ in range(n):
            if self._free:
                p = self._free.popleft()
            else:
                p = choose_eviction(self._evictable.keys()) if choose_eviction is not None else None
                if p is None:
                    p = next(iter(self._evictable))
                del self._evictable[p]
                page_hash = self._hash_of_page.pop(p)
                del self._page_of_hash[page_hash]
                self.num_evictions += 1
                if self.host_tier is not None:  # its KV is still in the page until the step that reuses it runs
                    self.host_tier.spill(p, page_hash)
            self._refcounts[p] = 1
            pages.append(p)
        return pages

    def incref(self, pages: Sequence[int]) -> None:
        for p in pages:
            if self._refcounts[p] == 0:
                if p not in self._evictable:
                    raise RuntimeError(f"incref of free page {p}")
                del self._evictable[p]
            self._refcounts[p] += 1

    def free(self, pages: Sequence[int]) -> None:
        # Released in reverse so a sequence's tail pages are evicted before its head: the head is the part other
        # requests share.
        for p in reversed(pages):
            rc = self._refcounts[p] - 1
            if rc < 0:
                raise RuntimeError(f"page {p} freed more often than allocated")
            self._refcounts[p] = rc
            if rc == 0:
                if p in self._hash_of_page:
                    self._evictable[p] = None
                else:
                    self._free.append(p)

    def refcount(self, page: int) -> int:
        return self._refcounts[page]

    def num_unreferenced(self, pages: Sequence[int]) -> int:
        """How many of `pages` have refcount 0 (cached hits that taking would revive), in one pass in C: a queued
        request's prefix hits are counted every step it is looked at."""
        refcounts = self._refcounts
        return [refcounts[p] for p in pages].count(0)

    # ---- prefix cache -----------------------------------------------------------------------------------------
    def lookup(self, hashes: Sequence[int]) -> list[int]:
        """Pages holding the longest cached prefix of `hashes` (no references taken; see `incref`)."""
        page_of_hash, pages = self._page_of_hash, []
        for h in hashes:
            p = page_of_hash.get(h)
            if p is None:
                break
            pages.append(p)
        return pages

    def num_cached(self, hashes: Sequence[int], limit: int) -> int:
        """len(lookup(hashes[:limit])), without building the list."""
        page_of_hash = self._page_of_hash
        for i in range(min(limit, len(hashes))):
            if hashes[i] not in page_of_hash:
                return i
        return min(limit, len(hashes))

    def register(self, page: int, page_hash: int) -> None:
        """Make an in-use page findable under `page_hash` (its KV is computed). A hash already cached elsewhere
        keeps its page: two sequences that computed the same prefix at once keep one copy in the cache."""
        if not self.enable_caching or page_hash in self._page_of_hash or page in self._hash_of_page:
            return
        if self._refcounts[page] <= 0:
            raise RuntimeError(f"register of free page {page}")
        self._page_of_hash[page_hash] = page
        self._hash_of_page[page] = page_hash

    def record_query(self, queried: int, hit: int) -> None:
        self.queried_tokens += queried
        self.hit_tokens += hit

    def check_consistent(self) -> None:
        """Raise if the free list, the LRU, the hash maps and the refcounts disagree (a test and debugging aid)."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("a page is on the free list twice")
        if free & set(self._evictable):
            raise AssertionError("a page is both free and evictable")
        for p, rc in enumerate(self._refcounts):
            if rc < 0:
                raise AssertionError(f"page {p} has negative refcount {rc}")
            idle = p in free or p in self._evictable
            if (rc == 0) != idle:
                raise AssertionError(f"page {p}: refcount {rc} but free/evictable: {idle}")
            if p in self._evictable and p not in self._hash_of_page:
                raise AssertionError(f"evictable page {p} has no hash")
        for h, p in self._page_of_hash.items():
            if self._hash_of_page.get(p) != h:
                raise AssertionError(f"hash maps disagree on page {p}")
        if len(self._page_of_hash) != len(self._hash_of_page):
            raise AssertionError("hash maps differ in size")
        if self.host_tier is not None:
            self.host_tier.check_consistent()
