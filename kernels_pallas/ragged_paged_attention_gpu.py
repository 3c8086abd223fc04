"""The GPU (Triton) kernel of `ragged_paged_attention` (see ragged_paged_attention.py for the op, its contract and
the tiling it shares with the TPU kernel): metadata read from plain refs, kv tiles gathered straight from the
[P, G, H] pages of the program's kv head, and an optional third grid axis splitting each sequence's kv tiles
(flash-decoding) whose partial softmaxes the wrapper merges."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels_pallas import common
from kernels_pallas import ragged_tiling as tiling


def _gpu_kernel(
    lens_ref,  # i32[S] kv_lens (whole array, read as scalars)
    pages_ref,  # i32[S, pages_per_seq_padded] page table, clipped
    cu_ref,  # i32[S + 1] cu_q_lens, empty past num_seqs
    seq_lo_ref,  # i32[num_q_blocks] first sequence in each block
    seq_hi_ref,  # i32[num_q_blocks] one past the last
    q_ref,  # [R, H] R = block_q * r_pad rows of kv head h
    k_ref,  # [P, G, H] every page of kv head h (a pointer; read by tile)
    v_ref,  # [P, G, H]
    k_scales_ref,  # f32 [P, G, 1] their scales (int8 pages), or None
    v_scales_ref,  # f32 [P, G, 1], or None
    o_ref,  # [R, H] output (one split) or f32 unnormalised partial
    *stat_refs,  # with splits: m_ref, l_ref f32 [R, 1] this split's max, sum
    sm_scale: float,
    soft_cap: float | None,
    sliding_window: int | None,
    block_q: int,
    rows_per_token: int,
    pages_per_tile: int,
):
    qb, split = pl.program_id(0), pl.program_id(2)
    num_splits = pl.num_programs(2)
    _, page_size, head_dim = k_ref.shape
    tile = pages_per_tile * page_size
    max_tiles = pages_ref.shape[1] // pages_per_tile
    q = q_ref[...]
    rows = q.shape[0]
    block = tiling.BlockRows(qb * block_q, rows, rows_per_token)

    def seq_body(i, carry):
        q_start, q_end, kv_len = cu_ref[i], cu_ref[i + 1], lens_ref[i]
        lo_tok, hi_tok = block.seq_window(q_start, q_end, kv_len, sliding_window)
        # Each split takes an even share of every sequence's tiles, so a block of
        # decode tokens with long contexts still spreads over many programs.
        start, stop = common.split_range(
            lax.div(lo_tok, tile), jnp.minimum(pl.cdiv(hi_tok, tile), max_tiles), split, num_splits
        )

        def tile_body(t, carry):
            m, l, acc = carry
            page_ids = pages_ref[i, pl.ds(t * pages_per_tile, pages_per_tile)]
            k = common.load_kv_tile(k_ref, k_scales_ref, page_ids, q.dtype).reshape(tile, head_dim)
            v = common.load_kv_tile(v_ref, v_scales_ref, page_ids, q.dtype).reshape(tile, head_dim)
            pos_row = t * tile + lax.broadcasted_iota(jnp.int32, (1, tile), 1)
            pos_col = t * tile + lax.broadcasted_iota(jnp.int32, (tile, 1), 0)
            return common.attend_tile(
                q,
                k,
                v,
                block.score_mask(q_start, q_end, kv_len, pos_row, sliding_window),
                pos_col < kv_len,
                m,
                l,
                acc,
                sm_scale=sm_scale,
                soft_cap=soft_cap,
            )

        return lax.fori_loop(start, stop, tile_body, carry)

    init = (
        jnp.full((rows, 1), -jnp.inf, jnp.float32),
        jnp.zeros((rows, 1), jnp.float32),
        jnp.zeros((rows, head_dim), jnp.float32),
    )
    m, l, acc = lax.fori_loop(seq_lo_ref[qb], seq_hi_ref[qb], seq_body, init)
    if stat_refs:
        m_ref, l_ref = stat_refs
        o_ref[...], m_ref[...], l_ref[...] = acc, m, l
    else:
        o_ref[...] = common.finalize(acc, l, o_ref.dtype)


def gpu_call(
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
    num_splits,
    interpret,
):
    num_kv_heads, total_rows, head_dim = q3.shape
    _, num_pages, page_size, _ = k_pages.shape
    rows = block_q * rows_per_token
    num_blocks = total_rows // rows
    tile = max(block_kv, page_size)
    pages_per_tile = tile // page_size
    # Whole tiles only: pad the table with page 0 (in bounds, masked by length).
    pages = jnp.pad(pages, ((0, 0), (0, -pages.shape[1] % pages_per_tile)))
    if num_splits is None:
        num_splits = common.default_gpu_splits(num_blocks * num_kv_heads, pages.shape[1] // pages_per_tile)

    kernel = functools.partial(
        _gpu_kernel,
        sm_scale=sm_scale,
        soft_cap=soft_cap,
        sliding_window=sliding_window,
        block_q=block_q,
        rows_per_token=rows_per_token,
        pages_per_tile=pages_per_tile,
    )
    whole = lambda shape: pl.BlockSpec(shape, lambda *_: (0,) * len(shape))
    q_spec = pl.BlockSpec((None, rows, head_dim), lambda qb, h, s: (h, qb, 0))
    kv_spec = pl.BlockSpec((None, num_pages, page_size, head_dim), lambda qb, h, s: (h, 0, 0, 0))
    kv_specs, kv_arrays = [kv_spec, kv_spec], [k_pages, v_pages]
    if k_scales is not None:
        # The scales of the kv head's pages, gathered by the same page ids as the pages.
        scale_spec = pl.BlockSpec((None, num_pages, page_size, 1), lambda qb, h, s: (h, 0, 0, 0))
        kv_specs, kv_arrays = kv_specs + [scale_spec, scale_spec], kv_arrays + [k_scales, v_scales]
    # Refs before the scale refs: 5 metadata, q, k, v.
    kernel = common.with_scale_refs(kernel, 8, k_scales is not None)
    if num_splits == 1:
        # One split finalises in the kernel: no f32 round trip through HBM.
        out_shape = jax.ShapeDtypeStruct(q3.shape, q3.dtype)
        out_specs = q_spec
    else:
        part = lambda last: pl.BlockSpec((None, None, rows, last), lambda qb, h, s: (s, h, qb, 0))
        part_shape = lambda last: jax.ShapeDtypeStruct((num_splits, num_kv_heads, total_rows, last), jnp.float32)
        out_shape = [part_shape(head_dim), part_shape(1), part_shape(1)]
        out_specs = [part(head_dim), part(1), part(1)]
    out = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(num_blocks, num_kv_heads, num_splits),
        in_specs=[
            whole(kv_lens.shape),
            whole(pages.shape),
            whole(cu.shape),
            whole(seq_lo.shape),
            whole(seq_hi.shape),
            q_spec,
            *kv_specs,
        ],
        out_specs=out_specs,
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name="ragged_paged_attention_gpu",
    )(kv_lens, pages, cu, seq_lo, seq_hi, q3, *kv_arrays)
    if num_splits == 1:
        return out
    return common.merge_partials(*out, q3.dtype)


# ----------------------------------------------------------------------------
# Public wrapper
