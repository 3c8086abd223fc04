"""Decode attention over a paged KV cache: one query token per sequence.

`paged_attention` runs one of two Pallas kernels over the shared page layout
(k_pages / v_pages [K, P, G, H], see docs/kernels.md):

* TPU (Mosaic): grid (B, K, pages). The page table and lengths are scalar
  prefetched into SMEM and the k/v BlockSpec index maps read them, so Pallas's
  own pipeline DMAs one [G, H] page of one kv head per grid step while the
  previous one is being used. Running max / sum / accumulator live in VMEM
  scratch across the page axis.
* GPU (Triton, paged_attention_gpu.py): grid (B, K, splits). Triton has no scalar prefetch, so each
  program reads the lengths and its page-table row from plain refs and walks
  its share of the context in tiles of several pages (gathered from the
  [P, G, H] pages of its kv head). Splitting the context (flash-decoding) keeps
  the GPU busy when B * K is small; the wrapper merges the partial softmaxes.

`reference_paged_attention` is the pure-jnp definition both are tested against.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas import common, kv_quant
from kernels_pallas.paged_attention_gpu import gpu_call

# Minimum query rows of a Triton tile: tl.dot needs M >= 16.
_GPU_MIN_ROWS = 16


def reference_paged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    kv_lens: jax.Array,
    page_indices: jax.Array,
    *,
    sm_scale: float | None = None,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None,
) -> jax.Array:
    """Pure-jnp decode attention; same contract as `paged_attention`.

    Gathers every sequence's pages into a contiguous [L, H] context per kv head
    and runs a masked softmax in f32. Slow (materialises all pages_per_seq
    pages), but each line is the definition. int8 pages are dequantized first
    (kv_quant.dequantize), so int8 attention is by definition attention over
    the dequantized pages.
    """
    common.check_kv_scales(k_pages, v_pages, k_scales, v_scales)
    if k_scales is not None:
        k_pages = kv_quant.dequantize(k_pages, k_scales)
        v_pages = kv_quant.dequantize(v_pages, v_scales)
    _, num_heads, head_dim = q.shape
    num_kv_heads, num_pages, page_size, _ = k_pages.shape
    batch, pages_per_seq = page_indices.shape
    if sm_scale is None:
        sm_scale = head_dim**-0.5
    length = pages_per_seq * page_size
    pages = jnp.clip(page_indices, 0, num_pages - 1)
    # [K, B, pages_per_seq, G, H] -> [K, B, L, H] -> one copy per query head.
    k = k_pages[:, pages].reshape(num_kv_heads, batch, length, head_dim)
    v = v_pages[:, pages].reshape(num_kv_heads, batch, length, head_dim)
    k = jnp.repeat(k, num_heads // num_kv_heads, axis=0).astype(jnp.float32)
    v = jnp.repeat(v, num_heads // num_kv_heads, axis=0).astype(jnp.float32)

    s = jnp.einsum("bnh,nblh->bnl", q.astype(jnp.float32), k, precision=lax.Precision.HIGHEST) * sm_scale
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    pos = jnp.arange(length)[None, :]  # [1, L]
    lens = kv_lens[:, None]  # [B, 1]
    ok = pos < lens
    if sliding_window is not None:
        ok &= pos > lens - 1 - sliding_window
    ok = ok[:, None, :]  # [B, 1, L]
    s = jnp.where(ok, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.where(ok, jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)  # [B, N, 1]
    v = jnp.where(jnp.transpose(ok, (1, 0, 2))[..., None], v, 0.0)
    o = jnp.einsum("bnl,nblh->bnh", p, v, precision=lax.Precision.HIGHEST)
    o = jnp.where(denom > 0, o / jnp.where(denom > 0, denom, 1.0), 0.0)
    return o.astype(q.dtype)


# ----------------------------------------------------------------------------
# TPU (Mosaic) kernel


def _tpu_kernel(
    lens_ref,  # SMEM i32[B] kv_lens
    first_page_ref,  # SMEM i32[B] first logical page inside the window
    pages_ref,  # SMEM i32[B * pages_per_seq] page table, flattened, clipped
    q_ref,  # VMEM [r, H] the r query heads of kv head h, sequence b
    k_ref,  # VMEM [G, H] one page of kv head h
    v_ref,  # VMEM [G, H]
    k_scales_ref,  # VMEM f32 [G, 1] that page's scales (int8 pages), or None
    v_scales_ref,  # VMEM f32 [G, 1], or None
    o_ref,  # VMEM [r, H]
    m_ref,  # VMEM f32 [r, 1] running max
    l_ref,  # VMEM f32 [r, 1] running sum of exp
    acc_ref,  # VMEM f32 [r, H] unnormalised output
    *,
    sm_scale: float,
    soft_cap: float | None,
    sliding_window: int | None,
):
    del pages_ref  # only the index maps read it
    b, j = pl.program_id(0), pl.program_id(2)
    page_size = k_ref.shape[0]
    kv_len = lens_ref[b]
    logical_page = first_page_ref[b] + j

    @pl.when(j == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    # Steps past the last page re-see the last page (its index map is clamped,
    # so no DMA is issued) and skip the math.
    @pl.when(logical_page * page_size < kv_len)
    def _attend():
        start = logical_page * page_size
        pos_row = start + lax.broadcasted_iota(jnp.int32, (1, page_size), 1)
        pos_col = start + lax.broadcasted_iota(jnp.int32, (page_size, 1), 0)
        ok_row, ok_col = pos_row < kv_len, pos_col < kv_len
        if sliding_window is not None:
            ok_row &= pos_row > kv_len - 1 - sliding_window
            ok_col &= pos_col > kv_len - 1 - sliding_window
        q = q_ref[...]
        m, l, acc = common.attend_tile(
            q,
            common.load_kv_tile(k_ref, k_scales_ref, ..., q.dtype),
            common.load_kv_tile(v_ref, v_scales_ref, ..., q.dtype),
            jnp.broadcast_to(ok_row, (q.shape[0], page_size)),
            ok_col,
            m_ref[...],
            l_ref[...],
            acc_ref[...],
            sm_scale=sm_scale,
            soft_cap=soft_cap,
        )
        m_ref[...], l_ref[...], acc_ref[...] = m, l, acc

    @pl.when(j == pl.num_programs(2) - 1)
    def _store():
        o_ref[...] = common.finalize(acc_ref[...], l_ref[...], o_ref.dtype)


def _tpu_call(
    q4,
    k_pages,
    v_pages,
    k_scales,
    v_scales,
    kv_lens,
    first_page,
    pages,
    *,
    sm_scale,
    soft_cap,
    sliding_window,
    interpret,
):
    batch, num_kv_heads, rows, head_dim = q4.shape
    _, _, page_size, _ = k_pages.shape
    pages_per_seq = pages.shape[1]
    steps = pages_per_seq
    if sliding_window is not None:
        # A window of w tokens touches at most cdiv(w - 1, G) + 1 pages.
        steps = min(steps, pl.cdiv(sliding_window - 1, page_size) + 1)

    def kv_index(b, h, j, lens, first, flat_pages):
        last = jnp.maximum(pl.cdiv(lens[b], page_size) - 1, 0)
        return (h, flat_pages[b * pages_per_seq + jnp.minimum(first[b] + j, last)], 0, 0)

    q_spec = pl.BlockSpec((None, None, rows, head_dim), lambda b, h, j, *_: (b, h, 0, 0))
    kv_spec = pl.BlockSpec((None, None, page_size, head_dim), kv_index)
    kv_specs, kv_arrays = [kv_spec, kv_spec], [k_pages, v_pages]
    if k_scales is not None:
        # One page's scales follow its page through the same index map.
        scale_spec = pl.BlockSpec((None, None, page_size, 1), kv_index)
        kv_specs, kv_arrays = kv_specs + [scale_spec, scale_spec], kv_arrays + [k_scales, v_scales]
    kernel = functools.partial(_tpu_kernel, sm_scale=sm_scale, soft_cap=soft_cap, sliding_window=sliding_window)
    # Refs before the scale refs: 3 scalar prefetch, q, k, v.
    kernel = common.with_scale_refs(kernel, 6, k_scales is not None)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(q4.shape, q4.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=(batch, num_kv_heads, steps),
            in_specs=[q_spec, *kv_specs],
            out_specs=q_spec,
            scratch_shapes=[
                pltpu.VMEM((rows, 1), jnp.float32),
                pltpu.VMEM((rows, 1), jnp.float32),
                pltpu.VMEM((rows, head_dim), jnp.float32),
            ],
        ),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name="paged_attention_tpu",
    )(kv_lens, first_page, pages.reshape(-1), q4, *kv_arrays)


@functools.partial(
    jax.jit,
    static_argnames=("sm_scale", "soft_cap", "sliding_window", "interpret", "platform", "block_kv", "num_splits"),
)
def paged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    kv_lens: jax.Array,
    page_indices: jax.Array,
    *,
    sm_scale: float | None = None,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    interpret: bool | pltpu.InterpretParams = False,
    platform: str | None = None,
    block_kv: int = 64,
    num_splits: int | None = None,
    k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None,
) -> jax.Array:
    """Decode attention of one new token per sequence against its paged KV.

    Args:
      q: [B, N, H] the query of each sequence's newest token.
      k_pages, v_pages: [K, P, G, H] the layer's KV pages, q's dtype or int8.
        Token p of sequence b lives at page page_indices[b, p // G], row p % G.
      kv_lens: i32[B] context length of each sequence, including the new token.
        0 marks an empty slot; its output is zeros.
      page_indices: i32[B, pages_per_seq] page table. Entries past
        cdiv(kv_lens[b], G) are ignored and may hold any value.
      sm_scale: score scale, default H ** -0.5.
      soft_cap: if set, scores = soft_cap * tanh(scores / soft_cap).
      sliding_window: if set, attend only to the last `sliding_window` tokens.
      interpret: True runs the kernel in the generic Pallas interpreter (CPU
        tests). TPU variant only: a pltpu.InterpretParams selects the TPU
        interpreter instead, which also simulates DMAs and can raise on
        out-of-bounds reads.
      platform: "tpu" (Mosaic kernel) or "gpu"/"cuda"/"rocm" (Triton kernel);
        None follows jax.default_backend() and means "tpu" in interpret mode on
        CPU.
      block_kv: GPU only: kv tokens per tile (rounded up to a whole page).
      num_splits: GPU only: programs per (sequence, kv head) splitting the
        context; None picks enough to fill the GPU.
      k_scales, v_scales: f32 [K, P, G, 1], required with (and only with) int8
        pages: row (k, p, g) stands for pages[k, p, g] * scales[k, p, g, 0]
        (kernels_pallas/kv_quant.py). Each kv tile is dequantized in f32 after
        loading, then cast to q's dtype. Scales of unused rows may be NaN.

    Returns:
      [B, N, H] in q's dtype. GQA: query head n reads kv head n // (N // K).

    Raises:
      ValueError: on mismatched shapes or dtypes, non-int32 metadata, invalid
        options, or (GPU) a page size / head dim that is not a power of two.
    """
    if q.ndim != 3:
        raise ValueError(f"q must be [B, N, H], got shape {q.shape}")
    common.check_kv_pages(q, k_pages, v_pages, k_scales, v_scales)
    batch, num_heads, head_dim = q.shape
    num_kv_heads, num_pages, page_size, _ = k_pages.shape
    common.check_int32("kv_lens", kv_lens, (batch,))
    if page_indices.ndim != 2 or page_indices.shape[0] != batch:
        raise ValueError(f"page_indices must be [B={batch}, pages_per_seq], got {page_indices.shape}")
    common.check_int32("page_indices", page_indices, page_indices.shape)
    common.check_options(sm_scale, soft_cap, sliding_window)
    variant = common.resolve_variant(platform, interpret)
    if variant == "gpu" and isinstance(interpret, pltpu.InterpretParams):
        raise ValueError("pltpu.InterpretParams only applies to the TPU variant")
    if sm_scale is None:
        sm_scale = head_dim**-0.5

    pages = common.sanitize_page_indices(page_indices, num_pages)
    if sliding_window is None:
        first_tok = jnp.zeros_like(kv_lens)
    else:
        first_tok = jnp.maximum(kv_lens - sliding_window, 0)
    r = num_heads // num_kv_heads

    if variant == "tpu":
        q4 = common.group_heads(q, num_kv_heads, r)
        o4 = _tpu_call(
            q4,
            k_pages,
            v_pages,
            k_scales,
            v_scales,
            kv_lens,
            first_tok // page_size,
            pages,
            sm_scale=sm_scale,
            soft_cap=soft_cap,
            sliding_window=sliding_window,
            interpret=interpret,
        )
    else:
        common.check_gpu_shapes(page_size, head_dim)
        if not common.is_pow2(block_kv) or block_kv < 16:
            raise ValueError(f"block_kv must be a power of two >= 16, got {block_kv}")
        if num_splits is not None and num_splits < 1:
            raise ValueError(f"num_splits must be >= 1, got {num_splits}")
        rows = max(_GPU_MIN_ROWS, common.next_pow2(r))
        q4 = common.group_heads(q, num_kv_heads, rows)
        o4 = gpu_call(
            q4,
            k_pages,
            v_pages,
            k_scales,
            v_scales,
            kv_lens,
            first_tok,
            pages,
            sm_scale=sm_scale,
            soft_cap=soft_cap,
            block_kv=block_kv,
            num_splits=num_splits,
            interpret=interpret,
        )
    return common.ungroup_heads(o4, num_heads)
