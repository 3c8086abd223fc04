"""The prefix cache's host tier: cached KV pages that the device pool evicts are copied to host memory, and a later
prefix hit copies them back instead of computing them again.

The device `PagePool` calls `spill(device page, hash)` when it reuses a cached page (refcount 0, registered hash):
the tier takes a host page (a free one, else its least recently used one) and queues a device->host copy. The
scheduler hands the queued copies to the step (`drain_into`): they go to SchedulerOutput.swap_out, which the runner
runs before anything else of the step, so the copy reads the page before the step overwrites it. A prefix lookup
goes on past the device hits into this tier (`prefix_hits`); the consecutive host hits are brought back
(`bring_back`): device pages are allocated, host->device copies go to swap_in (run after every swap_out of the step),
and the hashes are registered on the device again, so the request's prefill skips them exactly as device hits.

Choices:
- Inclusive: a page brought back stays in the tier (as its most recently used page). When the device evicts it
  again, the host already holds its KV and nothing is copied: a prefix that moves back and forth (multi-turn
  sessions) costs one copy out in all, not one per eviction.
- Its own budget: the host arrays of the runner (runner/kv_swap.py) hold the swap pool's `num_host_pages` pages
  first and this tier's pages after them (`base` = num_host_pages), so swap preemption never takes a cached page's
  place and the tier never takes room a preempted request needs.
- A host page that this step's copies write or read is pinned until they are handed over: a later spill in the
  same step must not reuse it as a copy-out destination (two copies into one page, or a copy out, which runs before
  every copy in, overwriting what a copy in reads). If every page is pinned, the evicted page is simply lost from the
  cache (`num_dropped`), as it would be without the tier.
"""

import collections
from collections.abc import Sequence

from cbjax.core.page_pool import chain_hashes
from cbjax.core.request import Request


class HostPrefixCache:
    """`num_pages` host pages (runner host page ids base..base+num_pages-1) caching KV pages of `page_size` tokens by
    chained hash (page_pool.chain_hashes), least recently used evicted first."""

    def __init__(self, num_pages: int, page_size: int, base: int = 0):
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        if base < 0:
            raise ValueError(f"base must be >= 0, got {base}")
        self.num_pages, self.page_size, self.base = num_pages, page_size, base
        self._free = collections.deque(range(num_pages))  # tier-local ids 0..num_pages-1
        self._page_of_hash: dict[int, int] = {}
        self._hash_of_page: dict[int, int] = {}
        self._lru: collections.OrderedDict[int, None] = collections.OrderedDict()  # pages holding KV, LRU first
        self._pinned: set[int] = set()
        self._copies_out: list[tuple[int, int]] = []  # (device page, host page id) queued for the next step
        self._copies_in: list[tuple[int, int]] = []  # (host page id, device page)
        # Cumulative counters (the engine reports per-step differences).
        self.num_pages_out = self.num_pages_in = 0  # pages copied device->host / host->device
        self.hit_tokens = 0  # tokens served from this tier: prefill recompute avoided
        self.num_evictions = 0  # host pages reused for another hash
        self.num_dropped = 0  # device evictions not kept (every host page pinned this step)

    @property
    def num_cached(self) -> int:
        return len(self._lru)

    def __contains__(self, page_hash: int) -> bool:
        return page_hash in self._page_of_hash

    def lru_hashes(self) -> list[int]:
        """The cached hashes, least recently used first (tests, debugging)."""
        return [self._hash_of_page[p] for p in self._lru]

    # ---- device -> host ---------------------------------------------------------------------------------------
    def spill(self, device_page: int, page_hash: int) -> None:
        """The device pool is reusing `device_page`, cached under `page_hash`: keep its KV here."""
        page = self._page_of_hash.get(page_hash)
        if page is not None:  # already here (inclusive tier): no copy, just fresh in the LRU
            self._lru.move_to_end(page)
            return
        if self._free:
            page = self._free.popleft()
        else:
            page = next((p for p in self._lru if p not in self._pinned), None)
            if page is None:
                self.num_dropped += 1
                return
            del self._lru[page]
            del self._page_of_hash[self._hash_of_page.pop(page)]
            self.num_evictions += 1
        self._page_of_hash[page_hash] = page
        self._hash_of_page[page] = page_hash
        self._lru[page] = None
        self._pinned.add(page)  # written by this step's copies: not reused before they run
        self._copies_out.append((device_page, self.base + page))
        self.num_pages_out += 1

    # ---- host -> device ---------------------------------------------------------------------------------------
    def num_hits(self, hashes: Sequence[int], start: int, stop: int) -> int:
        """How many of hashes[start:stop], consecutive from `start`, this tier holds."""
        page_of_hash, n = self._page_of_hash, 0
        for i in range(start, min(stop, len(hashes))):
            if hashes[i] not in page_of_hash:
                break
            n += 1
        return n

    def bring_back(self, hashes: Sequence[int], pool, choose_eviction=None) -> list[int]:
        """Device pages (refcount 1, registered under `hashes`) that will hold the KV of `hashes`, all held here:
        allocated from `pool` (which may spill other pages here), with their host->device copies queued."""
        pages = [self._page_of_hash[h] for h in hashes]  # KeyError: a caller's bug (counted with num_hits)
        self._pinned.update(pages)  # before allocating: the device's evictions must not take these host pages
        device = pool.allocate(len(pages), choose_eviction)
        for page, dev, h in zip(pages, device, hashes):
            self._lru.move_to_end(page)
            self._copies_in.append((self.base + page, dev))
            pool.register(dev, h)
        self.num_pages_in += len(pages)
        self.hit_tokens += len(pages) * self.page_size
        return device

    # ---- the step ---------------------------------------------------------------------------------------------
    def drain_into(self, swap_out: list, swap_in: list) -> None:
        """Hand the queued copies to the step (copies out before copies in, as the runner runs them) and unpin."""
        swap_out += self._copies_out
        swap_in += self._copies_in
        self._copies_out, self._copies_in = [], []
        self._pinned.clear()

    def check_consistent(self) -> None:
        """Raise if the free list, the LRU, the hash maps and the pins disagree: every host page is either free or
        holds exactly one hash (none lost, none leaked)."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("a host page is on the free list twice")
        if free & set(self._lru):
            raise AssertionError("a host page is both free and cached")
        if len(free) + len(self._lru) != self.num_pages:
            raise AssertionError(f"host pages lost: {len(free)} free + {len(self._lru)} cached != {self.num_pages}")
        if set(self._hash_of_page) != set(self._lru):
            raise AssertionError("the LRU and the hash maps hold different host pages")
        for h, p in self._page_of_hash.items():
            if self._hash_of_page.get(p) != h:
                raise AssertionError(f"hash maps disagree on host page {p}")
        if len(self._page_of_hash) != len(self._hash_of_page):
            raise AssertionError("host hash maps differ in size")
        if not self._pinned <= set(self._lru):
            raise AssertionError("a pinned host page holds nothing")
        targets = [h for _, h in self._copies_out]
        if len(set(targets)) != len(targets):
            raise AssertionError("two queued copies write one host page")


def prefix_hits(pool, host_cache: HostPrefixCache | None, req: Request, page_size: int) -> tuple[list[int], int]:
    """The longest cached prefix of `req`'s context across both tiers: (device pages of the device hits, number of host
    hits right after them). No reference taken, nothing copied. The last token is never a hit: the step computing it
    must produce its logits."""
    if not pool.enable_caching:
        return [], 0
    max_pages = (req.num_tokens - 1) // page_size
    chain_hashes(req.all_token_ids, page_size, req.page_hashes, upto=max_pages * page_size)
    hits = pool.lookup(req.page_hashes[:max_pages])
    if host_cache is None or len(hits) == max_pages:
        return hits, 0
    return hits, host_cache.num_hits(req.page_hashes, len(hits), max_pages)


def cached_prefix_pages(pool, host_cache: HostPrefixCache | None, req: Request, page_size: int) -> int:
    """How many pages `prefix_hits` would find, without building the list (read by policies for every queued request
    and step: `lpm` counts a host hit as a hit, a copy being far cheaper than recomputing the page)."""
    if not pool.enable_caching:
        return 0
    max_pages = (req.num_tokens - 1) // page_size
    if len(req.page_hashes) < max_pages:
        chain_hashes(req.all_token_ids, page_size, req.page_hashes, upto=max_pages * page_size)
    n = pool.num_cached(req.page_hashes, max_pages)
    if host_cache is not None and n < max_pages:
        n += host_cache.num_hits(req.page_hashes, n, max_pages)
    return n


def host_cache_counters(host_cache: HostPrefixCache | None) -> dict[str, int]:
    """The tier's cumulative counters under the names of the engine's step records (bench/metrics.StepRecord)."""
    if host_cache is None:
        return dict(prefix_host_hit_tokens=0, host_cache_out_pages=0, host_cache_in_pages=0)
    return dict(
        prefix_host_hit_tokens=host_cache.hit_tokens,
        host_cache_out_pages=host_cache.num_pages_out,
        host_cache_in_pages=host_cache.num_pages_in,
    )
