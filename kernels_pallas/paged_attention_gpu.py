"""The GPU (Triton) kernel of `paged_attention` (see paged_attention.py for the op and its contract): grid
(B, K, splits); each program reads the lengths and its page-table row from plain refs and walks its share of the
context in tiles of several pages, gathered from the [P, G, H] pages of its kv head; the wrapper merges the
splits' partial softmaxes (flash-decoding)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels_pallas import common


def _gpu_kernel(
    lens_ref,  # i32[B] kv_lens (whole array, read as scalars)
    first_tok_ref,  # i32[B] first token inside the window
    pages_ref,  # i32[B, pages_per_seq_padded] page table, clipped
    q_ref,  # [r_pad, H] query heads of kv head h (zero rows past r)
    k_ref,  # [P, G, H] every page of kv head h (a pointer; read by tile)
    v_ref,  # [P, G, H]
    k_scales_ref,  # f32 [P, G, 1] their scales (int8 pages), or None
    v_scales_ref,  # f32 [P, G, 1], or None
    o_ref,  # f32 [r_pad, H] this split's unnormalised output
    m_ref,  # f32 [r_pad, 1] this split's max
    l_ref,  # f32 [r_pad, 1] this split's sum of exp
    *,
    sm_scale: float,
    soft_cap: float | None,
    pages_per_tile: int,
):
    b, split = pl.program_id(0), pl.program_id(2)
    num_splits = pl.num_programs(2)
    _, page_size, head_dim = k_ref.shape
    tile = pages_per_tile * page_size
    kv_len = lens_ref[b]
    first_tok = first_tok_ref[b]

    # This split's tiles: an even share of the tiles that hold the window.
    start, stop = common.split_range(lax.div(first_tok, tile), pl.cdiv(kv_len, tile), split, num_splits)

    q = q_ref[...]
    rows = q.shape[0]

    def body(t, carry):
        m, l, acc = carry
        page_ids = pages_ref[b, pl.ds(t * pages_per_tile, pages_per_tile)]
        k = common.load_kv_tile(k_ref, k_scales_ref, page_ids, q.dtype).reshape(tile, head_dim)
        v = common.load_kv_tile(v_ref, v_scales_ref, page_ids, q.dtype).reshape(tile, head_dim)
        pos_row = t * tile + lax.broadcasted_iota(jnp.int32, (1, tile), 1)
        pos_col = t * tile + lax.broadcasted_iota(jnp.int32, (tile, 1), 0)
        ok_row = (pos_row < kv_len) & (pos_row >= first_tok)
        ok_col = (pos_col < kv_len) & (pos_col >= first_tok)
        return common.attend_tile(
            q, k, v, jnp.broadcast_to(ok_row, (rows, tile)), ok_col, m, l, acc, sm_scale=sm_scale, soft_cap=soft_cap
        )

    init = (
        jnp.full((rows, 1), -jnp.inf, jnp.float32),
        jnp.zeros((rows, 1), jnp.float32),
        jnp.zeros((rows, head_dim), jnp.float32),
    )
    m, l, acc = lax.fori_loop(start, stop, body, init)
    o_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = l


def gpu_call(
    q4,
    k_pages,
    v_pages,
    k_scales,
    v_scales,
    kv_lens,
    first_tok,
    pages,
    *,
    sm_scale,
    soft_cap,
    block_kv,
    num_splits,
    interpret,
):
    batch, num_kv_heads, rows, head_dim = q4.shape
    _, num_pages, page_size, _ = k_pages.shape
    tile = max(block_kv, page_size)
    pages_per_tile = tile // page_size
    # Whole tiles only: the last tile of the longest sequence may reach past the
    # table, so pad it with page 0 (in bounds, masked by length).
    pages = jnp.pad(pages, ((0, 0), (0, -pages.shape[1] % pages_per_tile)))
    max_tiles = pages.shape[1] // pages_per_tile
    if num_splits is None:
        num_splits = common.default_gpu_splits(batch * num_kv_heads, max_tiles)

    whole = lambda shape: pl.BlockSpec(shape, lambda *_: (0,) * len(shape))
    kv_spec = pl.BlockSpec((None, num_pages, page_size, head_dim), lambda b, h, s: (h, 0, 0, 0))
    kv_specs, kv_arrays = [kv_spec, kv_spec], [k_pages, v_pages]
    if k_scales is not None:
        # The scales of the kv head's pages, gathered by the same page ids as the pages.
        scale_spec = pl.BlockSpec((None, num_pages, page_size, 1), lambda b, h, s: (h, 0, 0, 0))
        kv_specs, kv_arrays = kv_specs + [scale_spec, scale_spec], kv_arrays + [k_scales, v_scales]
    part = lambda last: pl.BlockSpec((None, None, None, rows, last), lambda b, h, s: (s, b, h, 0, 0))
    part_shape = lambda last: jax.ShapeDtypeStruct((num_splits, batch, num_kv_heads, rows, last), jnp.float32)
    kernel = functools.partial(_gpu_kernel, sm_scale=sm_scale, soft_cap=soft_cap, pages_per_tile=pages_per_tile)
    # Refs before the scale refs: lens, first token, page table, q, k, v.
    kernel = common.with_scale_refs(kernel, 6, k_scales is not None)
    acc, m, l = pl.pallas_call(
        kernel,
        out_shape=[part_shape(head_dim), part_shape(1), part_shape(1)],
        grid=(batch, num_kv_heads, num_splits),
        in_specs=[
            whole(kv_lens.shape),
            whole(first_tok.shape),
            whole(pages.shape),
            pl.BlockSpec((None, None, rows, head_dim), lambda b, h, s: (b, h, 0, 0)),
            *kv_specs,
        ],
        out_specs=[part(head_dim), part(1), part(1)],
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name="paged_attention_gpu",
    )(kv_lens, first_tok, pages, q4, *kv_arrays)

    return common.merge_partials(acc, m, l, q4.dtype)


# ----------------------------------------------------------------------------
# Public wrapper
