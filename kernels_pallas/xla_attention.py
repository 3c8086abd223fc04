"""Ragged paged attention as plain XLA ops: the fast default on CPU, the engine's `xla` backend.

Same contract as `ragged_paged_attention` (docs/kernels.md): q [T, N, H]; k_pages, v_pages [K, P, G, H];
kv_lens [S]; page_indices [S, W]; cu_q_lens [S+1]; num_seqs [1]. Sequence i < num_seqs owns query rows
cu_q_lens[i]:cu_q_lens[i+1], the last q_len tokens of its kv_len context, whose K/V are already in the pages.

XLA wants static shapes, but the work must follow the step's real lengths, not its bucketed shapes: a step of
5 short decodes must not pay for 256 slots times max_model_len. So this is flash attention written with XLA
loops whose trip counts are runtime values (`lax.fori_loop` with traced bounds lowers to a while loop):
- decode (q_len == 1): blocks of `slot_block` sequences; per block, pages in blocks of `decode_kv_block` tokens up to
  the block's longest context. Cost ~ (decode sequences) x (their longest context).
- prefill (q_len > 1): the contexts of all multi-token sequences form one virtual concatenated buffer; query rows
  in blocks of `q_block`, each visiting only the kv blocks of the sequences it holds, up to its causal limit.
  Cost ~ sum over sequences of q_len x kv_len (plus block rounding), whatever the batch's shape.
Both use an online softmax in float32. Decode work is tightest when decodes come first in the batch (the runner
packs them so), but any order is correct. Masked K/V positions are zeroed before use, so NaN or stale data in
unused pages never reaches an output. Rows past cu_q_lens[num_seqs] are zeros.

Both halves have a faster twin on CPU: a C++ FFI kernel (cpu/attention.py) that walks the page table itself
(XLA's decode loop runs at ~2-3 GB/s of K/V, bound by gathers and tiny dots). `decode_impl` and `prefill_impl`
pick it per half: "ffi", "xla", or "auto" (the default; the environment variables CBJAX_DECODE_ATTENTION and
CBJAX_PREFILL_ATTENTION, "ffi" | "xla" | "auto", override them): the FFI kernel on the CPU backend when it
builds and cpu/auto.py's measured table takes it for this build (a build without AVX-512 keeps the XLA prefill
loop), else the XLA loop. With both on "ffi" one kernel call fills every row and no XLA loop runs.
"""

import functools
import logging
import os

import jax
import jax.numpy as jnp

from kernels_pallas import kv_quant
from kernels_pallas.cpu import attention as cpu_attention
from kernels_pallas.cpu import auto as cpu_auto

_NEG = -1e30
IMPLS = ("auto", "ffi", "xla")  # decode_impl and prefill_impl alike
DECODE_ENV_VAR = "CBJAX_DECODE_ATTENTION"
PREFILL_ENV_VAR = "CBJAX_PREFILL_ATTENTION"
_log = logging.getLogger("cbjax")


def _resolve(impl: str, env_var: str, name: str, kernel: str) -> str:
    impl = os.environ.get(env_var) or impl
    if impl not in IMPLS:
        raise ValueError(f"{name} ({env_var}) must be one of {IMPLS}, got {impl!r}")
    if impl == "ffi" and not cpu_attention.available():
        raise RuntimeError(f"{name}='ffi', but the CPU kernel is unavailable: {cpu_attention.unavailable_reason()}")
    if impl != "auto":
        return impl
    if jax.default_backend() != "cpu":
        return "xla"
    reason = cpu_auto.auto_reason(kernel)  # the kernel unavailable, or measured slower than XLA on this build
    if reason is None:
        return "ffi"
    _warn_unavailable_once(reason)
    return "xla"


def resolve_decode_impl(decode_impl: str = "auto") -> str:
    """ "ffi" or "xla" for the decode rows (see the module docstring); the environment variable wins."""
    return _resolve(decode_impl, DECODE_ENV_VAR, "decode_impl", "decode_attention")


def resolve_prefill_impl(prefill_impl: str = "auto") -> str:
    """ "ffi" or "xla" for the prefill rows (see the module docstring); the environment variable wins."""
    return _resolve(prefill_impl, PREFILL_ENV_VAR, "prefill_impl", "prefill_attention")


def resolve_cpu_impls() -> tuple[str, str, bool]:
    """(decode, prefill) implementations the default options trace to, and whether the C++ decode kernel may take
    bf16 dot products over bf16 pages ($CBJAX_ATTENTION_BF16_DOTS, read at trace time): part of every step
    program's key, so a program built under one choice is never loaded under another."""
    return resolve_decode_impl(), resolve_prefill_impl(), cpu_attention.resolve_bf16_dots()


@functools.cache
def _warn_unavailable_once(reason: str) -> None:
    _log.warning("cbjax: CPU attention kernel not used, taking the XLA path: %s", reason)


def _pad_to(x, multiple: int, axis: int, value=0):
    n = x.shape[axis]
    pad = (-n) % multiple
    if not pad:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths, constant_values=value)


def _online_update(carry, s, valid, v):
    """One flash-attention step. s [..., c] scores, valid [..., c], v [c-major, H] via einsum by the caller."""
    m, l, acc = carry
    s = jnp.where(valid, s, _NEG)
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    alpha = jnp.exp(m - m_new)
    p = jnp.where(valid, jnp.exp(s - m_new[..., None]), 0.0)
    return m_new, l * alpha + jnp.sum(p, axis=-1), acc * alpha[..., None], p


def xla_ragged_paged_attention(
    q,
    k_pages,
    v_pages,
    kv_lens,
    page_indices,
    cu_q_lens,
    num_seqs,
    *,
    sm_scale: float | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    slot_block: int = 32,
    decode_kv_block: int = 64,
    prefill_kv_block: int = 256,
    q_block: int = 128,
    decode_impl: str = "auto",
    prefill_impl: str = "auto",
    k_scales=None,
    v_scales=None,
):
    """int8 pages come with their scales k_scales / v_scales [K, P, G, 1] (kernels_pallas/kv_quant.py): each
    gathered block is dequantized in float32 before use, then masked like float pages (a NaN scale in an unused
    row never reaches an output)."""
    decode_impl = resolve_decode_impl(decode_impl)
    prefill_impl = resolve_prefill_impl(prefill_impl)
    q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs = (
        jnp.asarray(x) for x in (q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs)
    )
    k_scales, v_scales = (None if x is None else jnp.asarray(x) for x in (k_scales, v_scales))
    kv_quant.check_scales(k_pages, v_pages, k_scales, v_scales)
    # The C++ kernel (cpu/attention.py): `rows` says which sequences' rows it fills, zeros elsewhere.
    kernel_kw = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap)
    if k_scales is not None:
        kernel_kw.update(k_scales=k_scales, v_scales=v_scales)
    kernel = functools.partial(
        cpu_attention.cpu_ragged_attention, q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs
    )
    if decode_impl == prefill_impl == "ffi":  # one call fills every row, padding rows zero: no XLA loop at all
        return kernel(rows="both", **kernel_kw)
    dequant = lambda pages, scales, *idx: kv_quant.dequantize(pages[idx], None if scales is None else scales[idx])
    T, N, H = q.shape
    K, _, G, _ = k_pages.shape
    S, W = page_indices.shape
    R = N // K
    scale = H**-0.5 if sm_scale is None else sm_scale
    cap = (lambda s: s) if soft_cap is None else (lambda s: soft_cap * jnp.tanh(s / soft_cap))

    seq_valid = jnp.arange(S) < num_seqs[0]
    q_lens = jnp.where(seq_valid, cu_q_lens[1:] - cu_q_lens[:-1], 0)
    kv_lens = jnp.where(seq_valid, kv_lens, 0)
    is_decode = q_lens == 1
    is_prefill = q_lens > 1
    num_tokens = cu_q_lens[num_seqs[0]]
    t = jnp.arange(T)
    seg_t = jnp.clip(
        jnp.searchsorted(cu_q_lens, t, side="right", method="compare_all") - 1, 0, S - 1
    )  # [T] owning sequence
    row_valid = t < num_tokens
    qf = q.astype(jnp.float32) * scale

    # ---- decode: one query per sequence, blocks of sequences x blocks of pages ----------------------------------
    sb = min(slot_block, S)
    pb = max(1, min(decode_kv_block // G, W))  # pages per kv block
    dec_kv = _pad_to(jnp.where(is_decode, kv_lens, 0), sb, 0)
    dec_rows = _pad_to(jnp.clip(cu_q_lens[:-1], 0, T - 1), sb, 0)
    pt = _pad_to(_pad_to(page_indices, sb, 0), pb, 1)
    last_decode = jnp.max(jnp.where(is_decode, jnp.arange(S), -1))
    n_slot_blocks = (last_decode + sb) // sb

    def decode_slot_block(b, out):
        lo = b * sb
        kvl = jax.lax.dynamic_slice_in_dim(dec_kv, lo, sb)  # [sb]
        # Kv heads lead every operand so the batched matmuls need no transposes of the gathered pages.
        qb = qf[jax.lax.dynamic_slice_in_dim(dec_rows, lo, sb)].reshape(sb, K, R, H).transpose(1, 0, 2, 3)
        table = jax.lax.dynamic_slice_in_dim(pt, lo, sb, axis=0)  # [sb, W']
        n_kv = -(-jnp.max(kvl) // (pb * G))
        lo_pos = (
            jnp.zeros((), jnp.int32)
            if sliding_window is None
            else jnp.maximum(jnp.min(jnp.where(kvl > 0, kvl, jnp.iinfo(jnp.int32).max)) - sliding_window, 0)
        )
        first = jnp.minimum(lo_pos // (pb * G), n_kv)

        def kv_step(j, carry):
            pages = jax.lax.dynamic_slice_in_dim(table, j * pb, pb, axis=1)  # [sb, pb]
            pos = j * pb * G + jnp.arange(pb * G)
            valid = pos[None, :] < kvl[:, None]  # [sb, c]
            if sliding_window is not None:
                valid &= pos[None, :] > kvl[:, None] - 1 - sliding_window
            # Scores of masked positions are replaced (NaN-safe); V must be zeroed, since 0 * NaN is NaN.
            k = dequant(k_pages, k_scales, slice(None), pages).reshape(K, sb, pb * G, H)
            v = dequant(v_pages, v_scales, slice(None), pages).reshape(K, sb, pb * G, H)
            v = jnp.where(valid[None, :, :, None], v, 0.0)
            s = cap(jnp.einsum("ksrh,ksch->ksrc", qb, k))
            m, l, acc, p = _online_update(carry, s, valid[None, :, None, :], v)
            return m, l, acc + jnp.einsum("ksrc,ksch->ksrh", p, v)

        init = (jnp.full((K, sb, R), _NEG), jnp.zeros((K, sb, R)), jnp.zeros((K, sb, R, H)))
        _, l, acc = jax.lax.fori_loop(first, n_kv, kv_step, init)
        res = (acc / jnp.maximum(l, 1e-30)[..., None]).transpose(1, 0, 2, 3).reshape(sb, N, H)
        return jax.lax.dynamic_update_slice_in_dim(out, res, lo, 0)

    if decode_impl == "ffi":  # decode rows filled, zeros elsewhere
        dec_out = kernel(rows="decode", **kernel_kw).astype(jnp.float32)
    else:
        dec_out = jax.lax.fori_loop(0, n_slot_blocks, decode_slot_block, jnp.zeros((dec_kv.shape[0], N, H)))
        dec_out = dec_out[seg_t]  # [T, N, H]

    # ---- prefill: query-row blocks x blocks of the concatenated multi-token contexts ----------------------------
    qbk = min(q_block, T)
    kb = prefill_kv_block
    pf_kv = jnp.where(is_prefill, kv_lens, 0)
    cu_kv = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(pf_kv).astype(jnp.int32)])
    qpos = kv_lens[seg_t] - q_lens[seg_t] + (t - cu_q_lens[seg_t])  # [T] absolute position of each query
    row_pf = row_valid & is_prefill[seg_t]
    qf_p = _pad_to(qf, qbk, 0)
    seg_p = _pad_to(seg_t, qbk, 0)
    qpos_p = _pad_to(qpos, qbk, 0)
    row_pf_p = _pad_to(row_pf, qbk, 0, False)
    n_row_blocks = jnp.where(jnp.any(is_prefill), (num_tokens + qbk - 1) // qbk, 0)
    Tp = qf_p.shape[0]

    def prefill_row_block(i, out):
        r0 = i * qbk
        rows_pf = jax.lax.dynamic_slice_in_dim(row_pf_p, r0, qbk)
        segs = jax.lax.dynamic_slice_in_dim(seg_p, r0, qbk)
        qp = jax.lax.dynamic_slice_in_dim(qpos_p, r0, qbk)
        # [K, qbk * R, H]: each kv head's query rows form one matrix, so scores are one batched matmul per block.
        qb = (
            jax.lax.dynamic_slice_in_dim(qf_p, r0, qbk)
            .reshape(qbk, K, R, H)
            .transpose(1, 0, 2, 3)
            .reshape(K, qbk * R, H)
        )
        # The kv span this block can see: from its first prefill sequence's start to its last row's causal limit.
        first_seg = jnp.min(jnp.where(rows_pf, segs, S))
        kv_start = cu_kv[jnp.minimum(first_seg, S)]
        kv_end = jnp.max(jnp.where(rows_pf, cu_kv[segs] + qp + 1, 0))
        if sliding_window is not None:
            kv_start = jnp.maximum(
                kv_start, jnp.min(jnp.where(rows_pf, cu_kv[segs] + qp - sliding_window + 1, jnp.iinfo(jnp.int32).max))
            )
        j0 = kv_start // kb
        j1 = jnp.where(jnp.any(rows_pf), (kv_end + kb - 1) // kb, j0)

        def kv_step(j, carry):
            c = j * kb + jnp.arange(kb)
            seg_c = jnp.clip(jnp.searchsorted(cu_kv, c, side="right", method="compare_all") - 1, 0, S - 1)
            pos_c = c - cu_kv[seg_c]
            col_valid = c < cu_kv[-1]
            page = page_indices[seg_c, jnp.clip(pos_c // G, 0, W - 1)]
            k = dequant(k_pages, k_scales, slice(None), page, pos_c % G)
            v = jnp.where(col_valid[None, :, None], dequant(v_pages, v_scales, slice(None), page, pos_c % G), 0.0)
            valid = (
                rows_pf[:, None]
                & col_valid[None, :]
                & (segs[:, None] == seg_c[None, :])
                & (pos_c[None, :] <= qp[:, None])
            )
            if sliding_window is not None:
                valid &= pos_c[None, :] > qp[:, None] - sliding_window
            s = cap(jnp.einsum("kqh,kch->kqc", qb, k)).reshape(K, qbk, R, kb)
            m, l, acc, p = _online_update(carry, s, valid[None, :, None, :], v)
            return m, l, acc + jnp.einsum("kqc,kch->kqh", p.reshape(K, qbk * R, kb), v).reshape(K, qbk, R, H)

        init = (jnp.full((K, qbk, R), _NEG), jnp.zeros((K, qbk, R)), jnp.zeros((K, qbk, R, H)))
        _, l, acc = jax.lax.fori_loop(j0, j1, kv_step, init)
        res = (acc / jnp.maximum(l, 1e-30)[..., None]).transpose(1, 0, 2, 3).reshape(qbk, N, H)
        return jax.lax.dynamic_update_slice_in_dim(out, res, r0, 0)

    if prefill_impl == "ffi":  # prefill rows filled, zeros elsewhere
        pf_out = kernel(rows="prefill", **kernel_kw).astype(jnp.float32)
    else:
        pf_out = jax.lax.fori_loop(0, n_row_blocks, prefill_row_block, jnp.zeros((Tp, N, H)))[:T]

    use_dec = (is_decode[seg_t] & row_valid)[:, None, None]
    use_pf = row_pf[:, None, None]
    out = jnp.where(use_dec, dec_out, jnp.where(use_pf, pf_out, 0.0))
    return out.astype(q.dtype)
