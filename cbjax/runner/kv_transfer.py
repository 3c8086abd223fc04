"""The KV transfer of disaggregated serving (cbjax/disaggregated.py): a request's pages gathered on the prefill
engine's device, copied to the decode engine's device with jax.device_put (a copy between devices, not staged in
the host's memory by this code: how the backend moves the bytes is its own business; between fake CPU devices it
is a memcpy), and scattered into the pages the decode engine gave the request.

A page travels as kv_swap's blocks ([n, L, 2, K, G, X] per pair of cache arrays: K/V pages, then an int8 cache's
scales), with kv_swap's gather and scatter programs. Each call moves a bucketed number of pages (kv_swap.page_buckets:
powers of two), so a few programs serve every prompt length; `warmup` builds them on each engine's device. Padding
entries gather the source's spare page and land in the destination's spare page (garbage by design, kv_cache.py).
"""

import dataclasses
import time

import jax
import numpy as np

from cbjax.runner.kv_swap import gather_pages, page_buckets, scatter_pages
from cbjax.runner.model_runner import ModelRunner


@dataclasses.dataclass
class Transfer:
    """One request's KV moved between two runners."""

    num_pages: int
    nbytes: int
    # From the gather's dispatch to the gathered pages being ready: the gather and whatever the source device had
    # queued before it (its step in flight, which is compute, not transfer: hence apart from copy_s).
    wait_s: float
    # The copy between the devices, from the gathered pages being ready to their arrival on the destination device.
    # The scatter into the destination's pages is queued there before its next step and is not in it.
    copy_s: float


def _device_of(runner: ModelRunner):
    """The one device holding the runner's KV cache."""
    (device,) = runner.kv_caches[0][0].devices()
    return device


class KVTransfer:
    """Moves KV pages between ModelRunners of the same model and page layout (one device each: no mesh)."""

    def __init__(self, max_pages: int):
        """`max_pages`: the most pages one request holds (the buckets go up to it, capped as kv_swap's)."""
        self.buckets = page_buckets(max_pages)

    def _chunks(self, n: int):
        """(start, stop, bucket) of each call that moves n pages."""
        cap = self.buckets[-1]
        for lo in range(0, n, cap):
            m = min(cap, n - lo)
            yield lo, lo + m, next(b for b in self.buckets if m <= b)

    @staticmethod
    def _padded(pages, bucket: int, pad_page: int) -> np.ndarray:
        out = np.full(bucket, pad_page, np.int32)
        out[: len(pages)] = pages
        return out

    def send(self, src: ModelRunner, src_pages: list[int], dst: ModelRunner, dst_pages: list[int]) -> Transfer:
        """Copy the KV of `src_pages` of `src` into `dst_pages` of `dst` (as many, in order). The destination's
        cache is updated (its scatter queued on its device) when this returns; the source pages may be reused."""
        if len(src_pages) != len(dst_pages):
            raise ValueError(f"KV transfer of {len(src_pages)} pages into {len(dst_pages)}")
        chunks = list(self._chunks(len(src_pages)))
        t0 = time.perf_counter()
        with src.compiles.counting():
            gathered = [
                gather_pages(src.kv_caches, self._padded(src_pages[lo:hi], b, src.pad_page)) for lo, hi, b in chunks
            ]
        jax.block_until_ready(gathered)
        t1 = time.perf_counter()
        moved = jax.device_put(gathered, _device_of(dst))
        jax.block_until_ready(moved)
        t2 = time.perf_counter()
        with dst.compiles.counting():
            for (lo, hi, b), blocks in zip(chunks, moved):
                dst.kv_caches = scatter_pages(dst.kv_caches, self._padded(dst_pages[lo:hi], b, dst.pad_page), blocks)
        per_page = sum(int(np.prod(a.shape[1:])) * a.dtype.itemsize for a in gathered[0]) if chunks else 0
        return Transfer(len(src_pages), per_page * len(src_pages), t1 - t0, t2 - t1)

    def warmup(self, runner: ModelRunner) -> None:
        """Build the gather and the scatter of every bucket on `runner`'s device (touching only its spare page)."""
        with runner.compiles.counting():
            for b in self.buckets:
                idx = np.full(b, runner.pad_page, np.int32)
                runner.kv_caches = scatter_pages(runner.kv_caches, idx, gather_pages(runner.kv_caches, idx))
        jax.block_until_ready(runner.kv_caches)
