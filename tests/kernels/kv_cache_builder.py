"""Small paged KV caches for kernel tests, poisoned where kernels must not read.

Every page no live token uses, and every row past a sequence's kv_len in its
last page, holds NaN; page-table entries past a sequence's used pages hold
garbage ids (negative, too large, or pages of other sequences). A kernel that
lets any of that reach an output produces NaN, which the tests catch. Pages
are placed by a random permutation so that contiguous page ids never hide an
indexing bug.

int8 caches (quantize=True, kernels_pallas/kv_quant.py) cannot hold NaN in
their pages, so the poison moves to the scales: unused rows hold random int8
garbage and a NaN scale. A kernel that masks before dequantizing (or masks by
multiplying) then turns 0 * NaN into NaN and fails the same way.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas import kv_quant

# Shared by the kernel test files.
NUM_KV_HEADS = 2
PAGES_PER_SEQ = 4
TOLERANCE = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}
# The TPU variant runs under the TPU interpreter: it performs DMAs as late and
# as out of order as their semaphores allow, fills scratch with NaN, and raises
# on out-of-bounds reads; the generic interpreter (the only one for the GPU
# variant) copies at once and clamps indices, so it would hide such bugs.
INTERPRET = {"tpu": pltpu.InterpretParams(out_of_bounds_reads="raise"), "gpu": True}


@dataclasses.dataclass
class PagedKV:
    k_pages: jnp.ndarray  # [K, P, G, H], the kernel dtype or int8
    v_pages: jnp.ndarray  # [K, P, G, H]
    kv_lens: jnp.ndarray  # i32[S]
    page_indices: jnp.ndarray  # i32[S, pages_per_seq]
    # Per sequence, the contiguous context as float64 numpy [kv_len, K, H]: the
    # ground truth the pages were filled from (for int8, the dequantized rows).
    k_seqs: list[np.ndarray]
    v_seqs: list[np.ndarray]
    k_scales: jnp.ndarray | None = None  # f32 [K, P, G, 1] with int8 pages
    v_scales: jnp.ndarray | None = None

    @property
    def scales(self) -> dict:
        """The keyword args that pass this cache's scales (none for float pages) to a kernel or reference."""
        if self.k_scales is None:
            return {}
        return dict(k_scales=self.k_scales, v_scales=self.v_scales)


def build_paged_kv(
    rng: np.random.Generator,
    kv_lens,
    *,
    num_kv_heads: int,
    page_size: int,
    head_dim: int,
    pages_per_seq: int,
    dtype,
    spare_pages: int = 3,
    quantize: bool = False,
) -> PagedKV:
    """A poisoned cache holding random K/V for `kv_lens`; `dtype` is the page dtype, or with quantize=True the
    pages are int8 (kv_quant.quantize of the random rows) with float32 scales and `dtype` is unused."""
    kv_lens = np.asarray(kv_lens, np.int32)
    assert kv_lens.max(initial=0) <= pages_per_seq * page_size
    assert spare_pages > 0, "unused pages carry the poison"
    num_seqs = len(kv_lens)
    num_pages = num_seqs * pages_per_seq + spare_pages
    shape = (num_kv_heads, num_pages, page_size, head_dim)
    k_pages = np.full(shape, np.nan, np.float32)
    v_pages = np.full(shape, np.nan, np.float32)
    if quantize:
        k_pages = rng.integers(-128, 128, shape).astype(np.int8)
        v_pages = rng.integers(-128, 128, shape).astype(np.int8)
        k_scales = np.full((*shape[:3], 1), np.nan, np.float32)
        v_scales = np.full((*shape[:3], 1), np.nan, np.float32)
    page_indices = rng.integers(-num_pages, 2 * num_pages, (num_seqs, pages_per_seq)).astype(np.int32)
    free = list(rng.permutation(num_pages))
    k_seqs, v_seqs = [], []
    for s, length in enumerate(kv_lens):
        k, v = (rng.standard_normal((length, num_kv_heads, head_dim)) for _ in range(2))
        if quantize:
            # Per-token scales: (k_q, k_s) hold the [length, K, H] rows, and the truth is what they stand for.
            (k_q, k_s), (v_q, v_s) = (kv_quant.quantize(jnp.asarray(x, jnp.float32)) for x in (k, v))
            k, v = (np.asarray(kv_quant.dequantize(x, sc), np.float64) for x, sc in ((k_q, k_s), (v_q, v_s)))
            k_q, k_s, v_q, v_s = (np.asarray(x) for x in (k_q, k_s, v_q, v_s))
        else:
            # Round through the kernel dtype so the float64 truth matches the pages.
            k, v = (np.asarray(jnp.asarray(x, dtype), np.float64) for x in (k, v))
        k_seqs.append(k)
        v_seqs.append(v)
        for j in range(-(-length // page_size)):
            page = free.pop()
            page_indices[s, j] = page
            rows = slice(j * page_size, min((j + 1) * page_size, length))
            n = rows.stop - rows.start
            if quantize:
                k_pages[:, page, :n] = k_q[rows].transpose(1, 0, 2)
                v_pages[:, page, :n] = v_q[rows].transpose(1, 0, 2)
                k_scales[:, page, :n] = k_s[rows].transpose(1, 0, 2)
                v_scales[:, page, :n] = v_s[rows].transpose(1, 0, 2)
            else:
                k_pages[:, page, :n] = k[rows].transpose(1, 0, 2)
                v_pages[:, page, :n] = v[rows].transpose(1, 0, 2)
    cache = PagedKV(
        k_pages=jnp.asarray(k_pages, jnp.int8 if quantize else dtype),
        v_pages=jnp.asarray(v_pages, jnp.int8 if quantize else dtype),
        kv_lens=jnp.asarray(kv_lens, jnp.int32),
        page_indices=jnp.asarray(page_indices, jnp.int32),
        k_seqs=k_seqs,
        v_seqs=v_seqs,
    )
    if quantize:
        cache.k_scales, cache.v_scales = jnp.asarray(k_scales), jnp.asarray(v_scales)
    return cache


def ragged_metadata(q_lens, num_seqs: int, max_seqs: int, rng=None):
    """cu_q_lens i32[max_seqs + 1] and num_seqs i32[1].

    Entries past num_seqs are filled with garbage (decreasing, huge) when rng is
    given: the contract says they are ignored.
    """
    q_lens = np.asarray(q_lens[:num_seqs], np.int64)
    cu = np.zeros(max_seqs + 1, np.int32)
    cu[1 : num_seqs + 1] = np.cumsum(q_lens)
    if rng is not None:
        cu[num_seqs + 1 :] = rng.integers(-50, 10_000, max_seqs - num_seqs)
    else:
        cu[num_seqs + 1 :] = cu[num_seqs]
    return jnp.asarray(cu), jnp.asarray([num_seqs], jnp.int32)


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """One compiled shape and option set of a kernel test; each config replays several data scenarios."""

    page_size: int
    gqa: int  # query heads per kv head
    head_dim: int
    dtype: type
    sliding_window: int | None = None
    soft_cap: float | None = None
    block_q: int | None = None  # ragged only
    # Tokens per kv step. None: the test file's default; "default": the wrapper's own choice.
    block_kv: int | str | None = None
    num_splits: int | None = None
    kv_int8: bool = False  # int8 pages with float32 scales; `dtype` is then q's dtype only

    @property
    def options(self) -> dict:
        """The attention options both the kernel and its reference take."""
        return dict(soft_cap=self.soft_cap, sliding_window=self.sliding_window)

    def __str__(self):
        return (
            f"G{self.page_size}-r{self.gqa}-H{self.head_dim}-{jnp.dtype(self.dtype).name}-w{self.sliding_window}-"
            f"c{self.soft_cap}-q{self.block_q}-kv{self.block_kv}-s{self.num_splits}"
            + ("-int8kv" if self.kv_int8 else "")
        )


# Every (page size, GQA ratio) pair once, head dim and dtype alternating, the options spread over them: the full
# product is too slow to interpret on a small CPU. Each test file takes these and adds its own block options.
SHAPES = [
    dict(page_size=8, gqa=1, head_dim=64, dtype=jnp.float32),
    dict(page_size=8, gqa=4, head_dim=128, dtype=jnp.bfloat16, sliding_window=11),
    dict(page_size=8, gqa=8, head_dim=64, dtype=jnp.float32, soft_cap=20.0),
    dict(page_size=16, gqa=1, head_dim=128, dtype=jnp.bfloat16),
    dict(page_size=16, gqa=4, head_dim=64, dtype=jnp.float32, sliding_window=17, soft_cap=5.0),
    dict(page_size=16, gqa=8, head_dim=128, dtype=jnp.bfloat16, num_splits=3),
    dict(page_size=32, gqa=1, head_dim=64, dtype=jnp.bfloat16, soft_cap=30.0),
    dict(page_size=32, gqa=4, head_dim=128, dtype=jnp.float32),
    dict(page_size=32, gqa=8, head_dim=64, dtype=jnp.float32, sliding_window=40),
]
# int8 pages (q of the given dtype): few, because what they add over the float configs is the per-tile
# dequantization and the NaN scales of unused rows, not new tilings. Each q dtype once, the options on one.
INT8_SHAPES = [
    dict(page_size=8, gqa=4, head_dim=64, dtype=jnp.float32, sliding_window=11, soft_cap=20.0, kv_int8=True),
    dict(page_size=16, gqa=1, head_dim=128, dtype=jnp.bfloat16, kv_int8=True),
]


def make_cache_and_queries(config: KernelConfig, kv_lens, num_queries: int, rng: np.random.Generator):
    """A poisoned paged cache holding `kv_lens` and random queries [num_queries, N, H] of the config's dtype."""
    cache = build_paged_kv(
        rng,
        kv_lens,
        num_kv_heads=NUM_KV_HEADS,
        page_size=config.page_size,
        head_dim=config.head_dim,
        pages_per_seq=PAGES_PER_SEQ,
        dtype=config.dtype,
        quantize=config.kv_int8,
    )
    q = rng.standard_normal((num_queries, NUM_KV_HEADS * config.gqa, config.head_dim))
    return cache, jnp.asarray(q, config.dtype)


def check_against_reference(out, ref, config: KernelConfig, zero_rows, context: str) -> None:
    """The kernel's output has the reference's shape and the config's dtype, holds no NaN or inf (poison did not
    leak), is exactly zero on `zero_rows` (empty slots, padding rows), and matches the reference within the dtype's
    tolerance."""
    assert out.dtype == config.dtype and out.shape == ref.shape
    out = np.asarray(out, np.float32)
    ref = np.asarray(ref, np.float32)
    assert np.isfinite(out).all(), f"{context}: NaN/inf leaked from padding"
    assert (out[zero_rows] == 0).all(), f"{context}: empty slots and padding rows must be zeros"
    tol = TOLERANCE[config.dtype]
    np.testing.assert_allclose(out, ref, atol=tol, rtol=tol, err_msg=context)
