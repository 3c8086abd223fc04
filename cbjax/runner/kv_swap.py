"""Preemption by swap, the runner side: a host-memory pool of KV pages and the device-side page gather / scatter.
The prefix cache's host tier (core/host_prefix_cache.py) copies through the same pool: its pages follow the swap
pool's in the host arrays (CacheConfig.num_host_kv_pages), and its copies travel in the same swap lists.

A swapped-out page travels as one block holding every layer's K and V: [L, 2, K, G, H]. The host pool stores pages
contiguously ([NP, L, 2, K, G, H], NP host pages), so writing or reading one page is a single memcpy. An int8 cache
(kernels_pallas/kv_quant.py) moves each page's scales with it, as a second block [L, 2, K, G, 1] in a second host
array: a page and its scales always travel in the same call.

Each device call moves a bucketed number of pages (powers of two up to a cap), so there are only a few compiled
programs and warmup compiles all of them. Lists longer than the cap run as several calls of cap pages. Padding
entries gather from, and scatter to, the spare page `pad_page`, whose content is garbage by design.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from cbjax.model.config import ModelConfig
from cbjax.model.llama import kv_cache_dtype as kv_cache_dtype_of
from kernels_pallas.kv_write import is_sharded, take_pages, write_pages

# Smallest bucket: below this the per-call overhead dominates, and fewer buckets mean fewer programs to compile.
MIN_BUCKET = 4
# Largest bucket (pages per call): 64 pages bounds both the staging buffers and the padding waste of one call.
MAX_PAGES_PER_CALL = 64


def _groups(kv_caches) -> int:
    """Blocks per page: 1 (K and V pages), or 2 with an int8 cache's (k_scales, v_scales)."""
    return len(kv_caches[0]) // 2


@jax.jit
def _gather(kv_caches, idx):
    """kv_caches: L x (k [K, P+1, G, X], v same[, k_scales, v_scales]); idx: [n] int32 device pages -> one
    [n, L, 2, K, G, X] block per pair (pages, then scales)."""
    out = []
    for g in range(_groups(kv_caches)):
        pages = jnp.stack([jnp.stack([take_pages(c[2 * g], idx), take_pages(c[2 * g + 1], idx)]) for c in kv_caches])
        out.append(jnp.moveaxis(pages, 3, 0))  # [L, 2, K, n, G, X] -> [n, L, 2, K, G, X]
    return tuple(out)


# Donated like the runner's step, so the scatter updates the cache in place instead of copying every page (bfloat16
# pages on the CPU through kv_write's handler: XLA:CPU would convert the whole cache for a scatter).
@functools.partial(jax.jit, donate_argnums=(0,), static_argnames=("sharded",))
def _scatter(kv_caches, idx, blocks, sharded: bool = False):
    """Write blocks (as `_gather` returns them) into device pages idx [n]; returns the updated caches."""
    blocks = [jnp.moveaxis(b, 0, 3) for b in blocks]  # [L, 2, K, n, G, X]
    return [
        tuple(write_pages(a, blocks[i // 2][l, i % 2], idx, sharded=sharded) for i, a in enumerate(cache))
        for l, cache in enumerate(kv_caches)
    ]


def _scatter_into(kv_caches, idx, blocks):
    """_scatter, told whether the cache is split over devices (kv_write's handler has no sharding rule)."""
    return _scatter(kv_caches, idx, blocks, sharded=is_sharded(kv_caches[0][0]))


def page_buckets(num_device_pages: int, cap: int = MAX_PAGES_PER_CALL) -> tuple[int, ...]:
    """Pages per device call: powers of two from MIN_BUCKET up to min(cap, num_device_pages rounded up)."""
    top = min(cap, 1 << max(0, num_device_pages - 1).bit_length())
    out, b = [], MIN_BUCKET
    while b < top:
        out.append(b)
        b *= 2
    out.append(top)
    return tuple(sorted(set(out)))


class HostKVPool:
    """`num_host_pages` KV pages in host memory, and the copies between them and the device cache.

    Indices are not tracked here: the scheduler decides which host page holds what; this class only validates
    and copies.
    """

    def __init__(
        self,
        num_host_pages: int,
        *,
        num_device_pages: int,
        num_layers: int,
        num_kv_heads: int,
        page_size: int,
        head_dim: int,
        dtype,
        max_pages_per_call: int = MAX_PAGES_PER_CALL,
        quantized: bool = False,
    ):
        if num_host_pages < 1:
            raise ValueError(f"num_host_pages must be >= 1, got {num_host_pages}")
        self.num_host_pages = num_host_pages
        self.num_device_pages = num_device_pages
        self.pad_page = num_device_pages
        self.page_shape = (num_layers, 2, num_kv_heads, page_size, head_dim)  # [L, 2, K, G, H]
        self.dtype = np.dtype(jnp.dtype(dtype))
        # Each block of a page: the K/V pages, and an int8 cache's scales. (shape, dtype) per block.
        self.blocks = [(self.page_shape, self.dtype)]
        if quantized:
            self.blocks.append(((*self.page_shape[:-1], 1), np.dtype(np.float32)))
        # Allocated up front: the user sized the pool (swap_space_gib), and a failure should come at start-up.
        self.hosts = [np.empty((num_host_pages, *shape), dt) for shape, dt in self.blocks]  # [NP, L, 2, K, G, X]
        self.host = self.hosts[0]
        self.bytes_per_page = sum(int(np.prod(shape)) * dt.itemsize for shape, dt in self.blocks)
        self.buckets = page_buckets(num_device_pages, max_pages_per_call)

    # ---- validation -------------------------------------------------------------------------------------------
    def check(self, swap_out, swap_in) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Validate both lists (before any copy runs) and return them as int32 index arrays:
        (out device pages, out host pages, in host pages, in device pages)."""
        out_dev, out_host = self._pairs(swap_out, "swap_out", "device", "host")
        in_host, in_dev = self._pairs(swap_in, "swap_in", "host", "device")
        self._in_range(out_dev, self.num_device_pages, "swap_out", "device")
        self._in_range(out_host, self.num_host_pages, "swap_out", "host")
        self._in_range(in_host, self.num_host_pages, "swap_in", "host")
        self._in_range(in_dev, self.num_device_pages, "swap_in", "device")
        # Two copies into one destination page would leave one of them lost: always a caller's bug.
        self._unique(out_host, "swap_out", "host")
        self._unique(in_dev, "swap_in", "device")
        return out_dev, out_host, in_host, in_dev

    @staticmethod
    def _pairs(pairs, name: str, src: str, dst: str) -> tuple[np.ndarray, np.ndarray]:
        try:
            a = np.asarray([(int(s), int(d)) for s, d in pairs], np.int64).reshape(-1, 2)
        except (TypeError, ValueError):
            raise ValueError(f"{name} must be a list of ({src} page, {dst} page) integer pairs") from None
        return a[:, 0], a[:, 1]

    @staticmethod
    def _in_range(idx: np.ndarray, n: int, name: str, kind: str) -> None:
        bad = idx[(idx < 0) | (idx >= n)]
        if bad.size:
            raise ValueError(f"{name}: {kind} page indices outside [0, {n}): {bad[:5].tolist()}")

    @staticmethod
    def _unique(idx: np.ndarray, name: str, kind: str) -> None:
        vals, counts = np.unique(idx, return_counts=True)
        if (counts > 1).any():
            raise ValueError(f"{name}: {kind} pages written more than once: {vals[counts > 1][:5].tolist()}")

    # ---- copies -----------------------------------------------------------------------------------------------
    def _chunks(self, n: int):
        """(start, stop, bucket) for each device call that moves n pages."""
        cap = self.buckets[-1]
        for lo in range(0, n, cap):
            m = min(cap, n - lo)
            yield lo, lo + m, next(b for b in self.buckets if m <= b)

    def _padded(self, idx: np.ndarray, bucket: int) -> np.ndarray:
        out = np.full(bucket, self.pad_page, np.int32)
        out[: len(idx)] = idx
        return out

    def swap_out(self, kv_caches, device_pages: np.ndarray, host_pages: np.ndarray) -> None:
        """Copy device pages -> host pages (validated indices). Returns once the host pool holds the data."""
        chunks = list(self._chunks(len(device_pages)))
        # Dispatch every gather first, then fetch them in one device_get: the transfers overlap.
        gathered = [_gather(kv_caches, self._padded(device_pages[lo:hi], b)) for lo, hi, b in chunks]
        for (lo, hi, _), blocks in zip(chunks, jax.device_get(gathered)):
            for host, block in zip(self.hosts, blocks):
                host[host_pages[lo:hi]] = block[: hi - lo]  # the padding rows (spare page) are dropped here

    def swap_in(self, kv_caches, host_pages: np.ndarray, device_pages: np.ndarray):
        """Copy host pages -> device pages (validated indices); returns the new caches (the old are donated)."""
        for lo, hi, b in self._chunks(len(host_pages)):
            m = hi - lo
            staged = []
            for host, (shape, dt) in zip(self.hosts, self.blocks):
                block = np.empty((b, *shape), dt)
                block[:m] = host[host_pages[lo:hi]]
                block[m:] = 0  # goes to the spare page; zeros rather than whatever np.empty held (no stray NaN)
                staged.append(block)
            kv_caches = _scatter_into(kv_caches, self._padded(device_pages[lo:hi], b), tuple(staged))
        return kv_caches

    def warmup(self, kv_caches):
        """Compile the gather and the scatter of every bucket, touching only the spare page; returns the caches."""
        for b in self.buckets:
            idx = np.full(b, self.pad_page, np.int32)
            jax.block_until_ready(_gather(kv_caches, idx))
            zeros = tuple(np.zeros((b, *shape), dt) for shape, dt in self.blocks)
            kv_caches = _scatter_into(kv_caches, idx, zeros)
        jax.block_until_ready(kv_caches)
        return kv_caches


def build_host_pool(
    cfg: ModelConfig,
    num_host_pages: int,
    *,
    num_device_pages: int,
    page_size: int,
    kv_cache_dtype: str,
    max_pages_per_call: int = MAX_PAGES_PER_CALL,
) -> HostKVPool | None:
    """The host pool of `num_host_pages` pages for a device cache of `cfg` (allocate_kv_cache's geometry and dtype),
    or None for 0 (swapping off). Swaps move at most `max_pages_per_call` pages per device call (page_buckets)."""
    if num_host_pages < 0:
        raise ValueError(f"num_host_pages must be >= 0, got {num_host_pages}")
    if num_host_pages == 0:
        return None
    dt = kv_cache_dtype_of(cfg, kv_cache_dtype)
    return HostKVPool(
        num_host_pages,
        num_device_pages=num_device_pages,
        num_layers=cfg.num_layers,
        num_kv_heads=cfg.num_kv_heads,
        page_size=page_size,
        head_dim=cfg.dim_per_head,
        dtype=dt,
        max_pages_per_call=max_pages_per_call,
        quantized=dt == jnp.int8,
    )


def gather_pages(kv_caches, idx):
    """Device pages idx [n] of a cache as `_gather` returns them (one [n, L, 2, K, G, X] block per pair of arrays),
    on the cache's device: the disaggregated engine's transfer (kv_transfer.py) sends these blocks."""
    return _gather(kv_caches, idx)


def scatter_pages(kv_caches, idx, blocks):
    """Write `blocks` (as gather_pages returns them, on the cache's device) into device pages idx [n]; returns the
    updated caches (the old are donated)."""
    return _scatter_into(kv_caches, idx, blocks)
