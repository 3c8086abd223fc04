"""Copy-on-write, the runner side: device KV page copies (source page -> destination page, every layer's K and V,
and an int8 cache's scales) run before a step's program (core/sequence_group.py says when the scheduler asks).

One program, built at warmup: each call copies a fixed number of pages (the step's slots, max_num_seqs: a step
copies at most one page per scheduled sequence); padding pairs copy the spare page `pad_page` onto itself.
"""

import functools

import jax
import numpy as np

from kernels_pallas.kv_write import is_sharded, take_pages, write_pages


# Donated like the step, so the copy updates the cache in place instead of copying every page (bfloat16 pages on
# the CPU through kv_write's handler: XLA:CPU would convert the whole cache for a scatter).
@functools.partial(jax.jit, donate_argnums=(0,), static_argnames=("sharded",))
def _copy_pages(kv_caches, src, dst, sharded: bool = False):
    """kv_caches: L x (k [K, P+1, G, X], v same[, k_scales, v_scales]); src, dst [n] int32: page dst[i] <- src[i]."""
    return [tuple(write_pages(a, take_pages(a, src), dst, sharded=sharded) for a in cache) for cache in kv_caches]


def copy_pages(kv_caches, src, dst, sharded: bool | None = None):
    """Page dst[i] <- src[i] of every array of `kv_caches` (donated); `sharded` (None: read off the cache) keeps a
    cache split over devices on XLA's scatter."""
    if sharded is None:
        sharded = is_sharded(kv_caches[0][0])
    return _copy_pages(kv_caches, src, dst, sharded=sharded)


class PageCopier:
    """Copies device KV pages in calls of `pages_per_call` pairs (padded with the spare page)."""

    def __init__(self, pages_per_call: int, pad_page: int):
        self.pages_per_call = pages_per_call
        self.pad_page = pad_page
        self.num_copied = 0

    def _indices(self, pairs) -> tuple[np.ndarray, np.ndarray]:
        idx = np.full((2, self.pages_per_call), self.pad_page, np.int32)
        if pairs:
            idx[:, : len(pairs)] = np.asarray(pairs, np.int32).T
        return idx[0], idx[1]

    def __call__(self, kv_caches, pairs: list[tuple[int, int]]):
        """Copy every (source, destination) of `pairs` (distinct destinations, none of them a source); returns
        the new caches (the old are donated)."""
        for lo in range(0, len(pairs), self.pages_per_call):
            kv_caches = copy_pages(kv_caches, *self._indices(pairs[lo : lo + self.pages_per_call]))
        self.num_copied += len(pairs)
        return kv_caches

    def warmup(self, kv_caches):
        """Build the copy program (copying the spare page onto itself); returns the caches."""
        return jax.block_until_ready(copy_pages(kv_caches, *self._indices([])))
