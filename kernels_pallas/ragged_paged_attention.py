"""Ragged paged attention: prefill chunks and decodes in one flat token batch.

A step is T query tokens; sequence i < num_seqs[0] owns rows
cu_q_lens[i]:cu_q_lens[i+1], which are the *last* q_len tokens of its kv_len
context (their K/V are already in the pages). Query j of sequence i sits at
position kv_len - q_len + j and attends causally (optionally within a sliding
window). Every piece of batch metadata is a runtime int32 array, so one
compiled step serves any mix of prefills and decodes.

Both kernels tile the flat batch the same way: the wrapper lays q out as
[K, T * r_pad, H] (token-major, then the r query heads that share a kv head),
and a program owns one block of `block_q` tokens of one kv head. The wrapper
precomputes, per query block, the range of sequences that own rows in it; the
program walks those sequences and, for each, only the kv tiles its rows can
see. Each row belongs to exactly one sequence, so one running softmax per row
serves all of them (rows of other sequences are masked).

* TPU (Mosaic): metadata is scalar prefetched into SMEM; the pages stay in HBM
  (memory_space=ANY) and the kernel DMAs `block_kv` tokens' worth of pages
  into a double-buffered VMEM buffer, prefetching the next chunk while the
  current one is used. Running max / sum / accumulator are VMEM scratch.
* GPU (Triton, ragged_paged_attention_gpu.py): metadata is read from plain refs (Triton has no scalar
  prefetch); kv tiles are gathered straight from the [P, G, H] pages of the
  program's kv head, and the softmax state is carried in registers. A third
  grid axis splits every sequence's kv tiles (flash-decoding) when there are
  too few (block, head) programs to fill the GPU; the wrapper merges splits.

`reference_ragged_paged_attention` is the pure-jnp definition. The tiling helpers both kernels share are in
ragged_tiling.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas import common, kv_quant
from kernels_pallas import ragged_tiling as tiling
from kernels_pallas.ragged_paged_attention_gpu import gpu_call

# Query rows per program (tokens * padded heads per kv head) we aim for: enough
# rows to feed a matmul unit, few enough that a block of decode tokens (each
# its own sequence) does not waste much work on rows masked for the others.
_TARGET_ROWS = 32
_DEFAULT_BLOCK_KV = {"tpu": 128, "gpu": 64}


def reference_ragged_paged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    kv_lens: jax.Array,
    page_indices: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    sm_scale: float | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None,
) -> jax.Array:
    """Pure-jnp ragged paged attention; same contract as the kernel.

    Finds each token's sequence, gathers that sequence's whole context for the
    token and runs a masked softmax in f32. Memory is T * pages_per_seq * G * H
    per kv head: a test oracle, not a fast path. int8 pages are dequantized
    first (kv_quant.dequantize): int8 attention is by definition attention
    over the dequantized pages.
    """
    common.check_kv_scales(k_pages, v_pages, k_scales, v_scales)
    if k_scales is not None:
        k_pages = kv_quant.dequantize(k_pages, k_scales)
        v_pages = kv_quant.dequantize(v_pages, v_scales)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, num_pages, page_size, _ = k_pages.shape
    max_seqs, pages_per_seq = page_indices.shape
    if sm_scale is None:
        sm_scale = head_dim**-0.5
    length = pages_per_seq * page_size

    cu = tiling.valid_cu_q_lens(cu_q_lens, num_seqs)
    total = cu[-1]
    tok = jnp.arange(num_tokens)
    seq = jnp.minimum(jnp.searchsorted(cu[1:], tok, side="right"), max_seqs - 1)
    q_len = cu[seq + 1] - cu[seq]
    q_pos = kv_lens[seq] - q_len + (tok - cu[seq])  # [T]

    pages = jnp.clip(page_indices, 0, num_pages - 1)[seq]  # [T, pages_per_seq]
    k = k_pages[:, pages].reshape(num_kv_heads, num_tokens, length, head_dim)
    v = v_pages[:, pages].reshape(num_kv_heads, num_tokens, length, head_dim)
    k = jnp.repeat(k, num_heads // num_kv_heads, axis=0).astype(jnp.float32)
    v = jnp.repeat(v, num_heads // num_kv_heads, axis=0).astype(jnp.float32)

    s = jnp.einsum("tnh,ntlh->tnl", q.astype(jnp.float32), k, precision=lax.Precision.HIGHEST) * sm_scale
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    pos = jnp.arange(length)[None, :]  # [1, L]
    ok = (tok < total)[:, None] & (pos <= q_pos[:, None])  # [T, L]
    if sliding_window is not None:
        ok &= pos > q_pos[:, None] - sliding_window
    ok = ok[:, None, :]  # [T, 1, L]
    s = jnp.where(ok, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.where(ok, jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    v = jnp.where(jnp.transpose(ok, (1, 0, 2))[..., None], v, 0.0)
    o = jnp.einsum("tnl,ntlh->tnh", p, v, precision=lax.Precision.HIGHEST)
    o = jnp.where(denom > 0, o / jnp.where(denom > 0, denom, 1.0), 0.0)
    return o.astype(q.dtype)


# ----------------------------------------------------------------------------
# TPU (Mosaic) kernel


def _tpu_kernel(
    lens_ref,  # SMEM i32[S] kv_lens
    pages_ref,  # SMEM i32[S * pages_per_seq] page table, flattened, clipped
    cu_ref,  # SMEM i32[S + 1] cu_q_lens, empty past num_seqs
    seq_lo_ref,  # SMEM i32[num_q_blocks] first sequence in each block
    seq_hi_ref,  # SMEM i32[num_q_blocks] one past the last
    q_ref,  # VMEM [R, H] R = block_q * r_pad rows of kv head h
    k_hbm,  # HBM [K, P, G, H]
    v_hbm,  # HBM [K, P, G, H]
    k_scales_hbm,  # HBM f32 [K, P, G, 1] (int8 pages), or None
    v_scales_hbm,  # HBM f32 [K, P, G, 1], or None
    o_ref,  # VMEM [R, H]
    k_buf,  # VMEM [2, pages_per_chunk, G, H] double buffer
    v_buf,  # VMEM [2, pages_per_chunk, G, H]
    sems,  # DMA semaphores [2 (k, v) or 4 (k, v, k scales, v scales), 2 (slot)]
    m_ref,  # VMEM f32 [R, 1] running max
    l_ref,  # VMEM f32 [R, 1] running sum of exp
    acc_ref,  # VMEM f32 [R, H] unnormalised output
    *scale_bufs,  # int8 pages only: k_scales_buf, v_scales_buf VMEM f32 [2, pages_per_chunk, G, 1]
    sm_scale: float,
    soft_cap: float | None,
    sliding_window: int | None,
    block_q: int,
    rows_per_token: int,
    pages_per_seq: int,
):
    qb, h = pl.program_id(0), pl.program_id(1)
    k_scales_buf, v_scales_buf = scale_bufs or (None, None)
    pages_per_chunk, page_size = k_buf.shape[1], k_buf.shape[2]
    rows = q_ref.shape[0]
    block = tiling.BlockRows(qb * block_q, rows, rows_per_token)

    m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    def seq_body(i, _):
        q_start, q_end, kv_len = cu_ref[i], cu_ref[i + 1], lens_ref[i]
        lo_tok, hi_tok = block.seq_window(q_start, q_end, kv_len, sliding_window)
        # lax.div/rem, not // and %: both operands are >= 0, and jnp's floor
        # semantics emit a sign op whose Mosaic lowering needs a real TPU to ask
        # for its generation (it fails when lowering on a CPU host).
        lo_page = lax.div(lo_tok, page_size)
        hi_page = jnp.minimum(pl.cdiv(hi_tok, page_size), pages_per_seq)
        num_chunks = pl.cdiv(jnp.maximum(hi_page - lo_page, 0), pages_per_chunk)

        def copies(chunk, p, slot):
            page = pages_ref[i * pages_per_seq + lo_page + chunk * pages_per_chunk + p]
            pairs = [(k_hbm, k_buf), (v_hbm, v_buf)]
            if scale_bufs:
                # A page's scales travel with it: same page id, same slot, their own semaphores (a wait is
                # sized by its copy, so copies of different sizes must not share one).
                pairs += [(k_scales_hbm, k_scales_buf), (v_scales_hbm, v_scales_buf)]
            return [
                pltpu.make_async_copy(src.at[h, page], dst.at[slot, p], sems.at[n, slot])
                for n, (src, dst) in enumerate(pairs)
            ]

        def in_range(chunk, p):
            return lo_page + chunk * pages_per_chunk + p < hi_page

        def start_chunk(chunk, slot):
            for p in range(pages_per_chunk):

                @pl.when(in_range(chunk, p))
                def _start():
                    for c in copies(chunk, p, slot):
                        c.start()

        @pl.when(num_chunks > 0)
        def _first():
            start_chunk(0, 0)

        def chunk_body(chunk, _):
            slot = lax.rem(chunk, 2)

            # Fetch the next chunk into the other buffer while this one is used;
            # that buffer's previous chunk was consumed in the last iteration.
            @pl.when(chunk + 1 < num_chunks)
            def _prefetch():
                start_chunk(chunk + 1, 1 - slot)

            # Wait for the whole chunk before reading any of it: copies sharing a
            # semaphore may land in any order, so a wait sized for page p only
            # proves that *some* page of the chunk has arrived.
            for p in range(pages_per_chunk):

                @pl.when(in_range(chunk, p))
                def _wait():
                    for c in copies(chunk, p, slot):
                        c.wait()

            for p in range(pages_per_chunk):

                @pl.when(in_range(chunk, p))
                def _attend():
                    start = (lo_page + chunk * pages_per_chunk + p) * page_size
                    pos_row = start + lax.broadcasted_iota(jnp.int32, (1, page_size), 1)
                    pos_col = start + lax.broadcasted_iota(jnp.int32, (page_size, 1), 0)
                    q = q_ref[...]
                    m, l, acc = common.attend_tile(
                        q,
                        common.load_kv_tile(k_buf, k_scales_buf, (slot, p), q.dtype),
                        common.load_kv_tile(v_buf, v_scales_buf, (slot, p), q.dtype),
                        block.score_mask(q_start, q_end, kv_len, pos_row, sliding_window),
                        pos_col < kv_len,
                        m_ref[...],
                        l_ref[...],
                        acc_ref[...],
                        sm_scale=sm_scale,
                        soft_cap=soft_cap,
                    )
                    m_ref[...], l_ref[...], acc_ref[...] = m, l, acc

        lax.fori_loop(0, num_chunks, chunk_body, None)

    lax.fori_loop(seq_lo_ref[qb], seq_hi_ref[qb], seq_body, None)
    o_ref[...] = common.finalize(acc_ref[...], l_ref[...], o_ref.dtype)


def _tpu_call(
    q3,
    k_pages,
    v_pages,
    k_scales,
    v_scales,
    kv_lens,
    pages,
    cu,
    seq_lo,
    seq_hi,
    *,
    sm_scale,
    soft_cap,
    sliding_window,
    block_q,
    rows_per_token,
    block_kv,
    interpret,
):
    num_kv_heads, total_rows, head_dim = q3.shape
    _, _, page_size, _ = k_pages.shape
    rows = block_q * rows_per_token
    pages_per_chunk = max(1, block_kv // page_size)
    kernel = functools.partial(
        _tpu_kernel,
        sm_scale=sm_scale,
        soft_cap=soft_cap,
        sliding_window=sliding_window,
        block_q=block_q,
        rows_per_token=rows_per_token,
        pages_per_seq=pages.shape[1],
    )
    q_spec = pl.BlockSpec((None, rows, head_dim), lambda qb, h, *_: (h, qb, 0))
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    buf = pltpu.VMEM((2, pages_per_chunk, page_size, head_dim), k_pages.dtype)
    kv_arrays, num_sems, scale_bufs = [k_pages, v_pages], 2, []
    if k_scales is not None:
        # The scales stay in HBM like the pages and are DMAed next to them into [2, chunk, G, 1] buffers.
        kv_arrays += [k_scales, v_scales]
        num_sems = 4
        scale_bufs = [pltpu.VMEM((2, pages_per_chunk, page_size, 1), jnp.float32)] * 2
    # Refs before the scale refs: 5 scalar prefetch, q, k, v.
    kernel = common.with_scale_refs(kernel, 8, k_scales is not None)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(q3.shape, q3.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=5,
            grid=(total_rows // rows, num_kv_heads),
            in_specs=[q_spec] + [hbm] * len(kv_arrays),
            out_specs=q_spec,
            scratch_shapes=[
                buf,
                buf,
                pltpu.SemaphoreType.DMA((num_sems, 2)),
                pltpu.VMEM((rows, 1), jnp.float32),
                pltpu.VMEM((rows, 1), jnp.float32),
                pltpu.VMEM((rows, head_dim), jnp.float32),
                *scale_bufs,
            ],
        ),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=interpret,
        name="ragged_paged_attention_tpu",
    )(kv_lens, pages.reshape(-1), cu, seq_lo, seq_hi, q3, *kv_arrays)


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale",
        "sliding_window",
        "soft_cap",
        "interpret",
        "platform",
        "block_q",
        "block_kv",
        "num_splits",
    ),
)
def ragged_paged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    kv_lens: jax.Array,
    page_indices: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    sm_scale: float | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    interpret: bool | pltpu.InterpretParams = False,
    platform: str | None = None,
    block_q: int | None = None,
    block_kv: int | None = None,
    num_splits: int | None = None,
    k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None,
) -> jax.Array:
    """Causal attention of a flat, ragged batch of new tokens to paged KV.

    Args:
      q: [T, N, H] new tokens of all sequences, concatenated, then padding.
      k_pages, v_pages: [K, P, G, H] the layer's KV pages, q's dtype or int8,
        already holding the new tokens' K/V. Token p of sequence i lives at page
        page_indices[i, p // G], row p % G.
      kv_lens: i32[S] context length of each sequence, new tokens included.
      page_indices: i32[S, pages_per_seq] page table. Entries past
        cdiv(kv_lens[i], G) are ignored and may hold any value.
      cu_q_lens: i32[S + 1] row offsets: sequence i owns rows
        cu_q_lens[i]:cu_q_lens[i + 1] (may be empty). Must be nondecreasing up
        to index num_seqs[0]; entries after it are ignored.
      num_seqs: i32[1] number of live sequences; the rest are ignored.
      sm_scale: score scale, default H ** -0.5.
      sliding_window: if set, query at position x sees only positions > x - w.
      soft_cap: if set, scores = soft_cap * tanh(scores / soft_cap).
      interpret: True runs the kernel in the generic Pallas interpreter (CPU
        tests). TPU variant only: a pltpu.InterpretParams selects the TPU
        interpreter instead, which also simulates DMAs and can raise on
        out-of-bounds reads.
      platform: "tpu" (Mosaic kernel) or "gpu"/"cuda"/"rocm" (Triton kernel);
        None follows jax.default_backend() and means "tpu" in interpret mode on
        CPU.
      block_q: tokens per program (power of two); default fills ~32 rows.
      block_kv: kv tokens fetched per step (power of two, >= 16); default 128
        on TPU, 64 on GPU. Rounded up to a whole page.
      num_splits: GPU only: programs per (query block, kv head) splitting each
        sequence's kv tiles; None picks enough to fill the GPU.
      k_scales, v_scales: f32 [K, P, G, 1], required with (and only with) int8
        pages: row (k, p, g) stands for pages[k, p, g] * scales[k, p, g, 0]
        (kernels_pallas/kv_quant.py). Each kv tile is dequantized in f32 after
        loading, then cast to q's dtype. Scales of unused rows may be NaN.

    Returns:
      [T, N, H] in q's dtype. Rows >= cu_q_lens[num_seqs[0]] are zeros.

    Raises:
      ValueError: on mismatched shapes or dtypes, non-int32 metadata, invalid
        options, or (GPU) a page size / head dim that is not a power of two.
    """
    if q.ndim != 3:
        raise ValueError(f"q must be [T, N, H], got shape {q.shape}")
    common.check_kv_pages(q, k_pages, v_pages, k_scales, v_scales)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, num_pages, page_size, _ = k_pages.shape
    if kv_lens.ndim != 1:
        raise ValueError(f"kv_lens must be [S], got shape {kv_lens.shape}")
    max_seqs = kv_lens.shape[0]
    common.check_int32("kv_lens", kv_lens, (max_seqs,))
    if page_indices.ndim != 2 or page_indices.shape[0] != max_seqs:
        raise ValueError(f"page_indices must be [S={max_seqs}, pages_per_seq], got {page_indices.shape}")
    common.check_int32("page_indices", page_indices, page_indices.shape)
    common.check_int32("cu_q_lens", cu_q_lens, (max_seqs + 1,))
    common.check_int32("num_seqs", num_seqs, (1,))
    common.check_options(sm_scale, soft_cap, sliding_window)
    variant = common.resolve_variant(platform, interpret)
    if variant == "gpu" and isinstance(interpret, pltpu.InterpretParams):
        raise ValueError("pltpu.InterpretParams only applies to the TPU variant")
    if variant == "gpu":
        common.check_gpu_shapes(page_size, head_dim)
    if sm_scale is None:
        sm_scale = head_dim**-0.5

    rows_per_token = common.next_pow2(num_heads // num_kv_heads)
    if block_q is None:
        block_q = max(1, _TARGET_ROWS // rows_per_token)
    if not common.is_pow2(block_q):
        raise ValueError(f"block_q must be a power of two, got {block_q}")
    if block_q * rows_per_token < 16 and variant == "gpu":
        raise ValueError(
            f"GPU kernel needs block_q * r_pad >= 16 query rows (tl.dot), got {block_q} * {rows_per_token}"
        )
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    if block_kv is None:
        block_kv = _DEFAULT_BLOCK_KV[variant]
    if not common.is_pow2(block_kv) or block_kv < 16:
        raise ValueError(f"block_kv must be a power of two >= 16, got {block_kv}")

    cu = tiling.valid_cu_q_lens(cu_q_lens, num_seqs)
    seq_lo, seq_hi = tiling.block_seq_ranges(cu, num_tokens, block_q)
    pages = common.sanitize_page_indices(page_indices, num_pages)

    # [T, N, H] -> [K, T_pad * r_pad, H]: one kv head's rows are contiguous and
    # a block of block_q tokens is a plain 2-D tile.
    padded_tokens = pl.cdiv(num_tokens, block_q) * block_q
    q_pad = jnp.pad(q, ((0, padded_tokens - num_tokens), (0, 0), (0, 0)))
    q3 = common.group_heads(q_pad, num_kv_heads, rows_per_token)
    q3 = q3.transpose(1, 0, 2, 3).reshape(num_kv_heads, -1, head_dim)

    call_options = dict(
        sm_scale=sm_scale,
        soft_cap=soft_cap,
        sliding_window=sliding_window,
        block_q=block_q,
        rows_per_token=rows_per_token,
        block_kv=block_kv,
        interpret=interpret,
    )
    args = (q3, k_pages, v_pages, k_scales, v_scales, kv_lens, pages, cu, seq_lo, seq_hi)
    if variant == "tpu":
        o3 = _tpu_call(*args, **call_options)
    else:
        o3 = gpu_call(*args, num_splits=num_splits, **call_options)
    o = o3.reshape(num_kv_heads, padded_tokens, rows_per_token, head_dim)
    o = common.ungroup_heads(o.transpose(1, 0, 2, 3), num_heads)
    return o[:num_tokens]
