"""Ragged paged attention as plain XLA ops: the fast default on CPU, and the engine's `reference` backend.

Same contract as `ragged_paged_attention` (see docs/kernels.md): q [T, N, H]; k_pages, v_pages [K, P, G, H];
kv_lens [S]; page_indices [S, W]; cu_q_lens [S+1]; num_seqs [1]. Sequence i < num_seqs owns query rows
cu_q_lens[i]:cu_q_lens[i+1], the last q_len tokens of its kv_len context, whose K/V are already in the pages.

XLA needs static shapes, so the cost must follow the bucketed page-table width W rather than max_model_len, and
a step's mix of long prefills and many decodes must not multiply. Two paths, each skipped by `lax.cond` when the
step has no sequence of its kind:
- decode (q_len == 1): one query per sequence against its own W * G pages: [S, N, W*G] scores.
- prefill (q_len > 1): the contexts of all multi-token sequences are gathered into ONE buffer of C = W * G
  positions, and every query row attends to it with a mask (same sequence, causal). Cost T * C, i.e. that of a
  dense attention over the step, not slots * longest-prompt.
Precondition of the prefill path (the scheduler enforces it via `max_prefill_kv_tokens`): the summed kv_lens of
the multi-token sequences fit in C = W * G.
Masked-out K/V positions are zeroed before use, so NaN or stale data in unused pages never reaches an output.
"""
import jax
import jax.numpy as jnp

_NEG = -1e30


def _softcap(s, soft_cap):
    return s if soft_cap is None else soft_cap * jnp.tanh(s / soft_cap)


def xla_ragged_paged_attention(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *,
                               sm_scale: float | None = None, sliding_window: int | None = None,
                               soft_cap: float | None = None):
    T, N, H = q.shape
    K, _, G, _ = k_pages.shape
    S, W = page_indices.shape
    C = W * G
    R = N // K
    scale = H ** -0.5 if sm_scale is None else sm_scale

    seq_valid = jnp.arange(S) < num_seqs[0]
    q_lens = jnp.where(seq_valid, cu_q_lens[1:] - cu_q_lens[:-1], 0)
    kv_lens = jnp.where(seq_valid, kv_lens, 0)
    is_decode = q_lens == 1
    is_prefill = q_lens > 1

    t = jnp.arange(T)
    seg_t = jnp.clip(jnp.searchsorted(cu_q_lens, t, side="right") - 1, 0, S - 1)  # [T] owning sequence
    row_valid = t < cu_q_lens[num_seqs[0]]
    qf = q.astype(jnp.float32) * scale

    def decode_path():
        q_dec = qf[jnp.clip(cu_q_lens[:-1], 0, T - 1)].reshape(S, K, R, H)
        k = k_pages[:, page_indices].reshape(K, S, C, H)  # [K, S, C, H]
        v = v_pages[:, page_indices].reshape(K, S, C, H)
        pos = jnp.arange(C)
        valid = pos[None, :] < kv_lens[:, None]  # [S, C]
        if sliding_window is not None:
            valid &= pos[None, :] > kv_lens[:, None] - 1 - sliding_window
        k = jnp.where(valid[None, :, :, None], k.astype(jnp.float32), 0.0)
        v = jnp.where(valid[None, :, :, None], v.astype(jnp.float32), 0.0)
        s = _softcap(jnp.einsum("skrh,ksch->skrc", q_dec, k), soft_cap)
        s = jnp.where(valid[:, None, None, :], s, _NEG)
        p = jax.nn.softmax(s, axis=-1)
        out = jnp.einsum("skrc,ksch->skrh", p, v).reshape(S, N, H)
        return out[seg_t]  # [T, N, H]; rows of other sequences are discarded below

    def prefill_path():
        pf_kv = jnp.where(is_prefill, kv_lens, 0)
        cu_kv = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(pf_kv).astype(jnp.int32)])
        c = jnp.arange(C)
        seg_c = jnp.clip(jnp.searchsorted(cu_kv, c, side="right") - 1, 0, S - 1)  # [C] owning sequence
        pos_c = c - cu_kv[seg_c]
        col_valid = c < cu_kv[-1]
        page = page_indices[seg_c, jnp.clip(pos_c // G, 0, W - 1)]
        k = k_pages[:, page, pos_c % G].astype(jnp.float32)  # [K, C, H]
        v = v_pages[:, page, pos_c % G].astype(jnp.float32)
        k = jnp.where(col_valid[None, :, None], k, 0.0)
        v = jnp.where(col_valid[None, :, None], v, 0.0)
        qpos = kv_lens[seg_t] - q_lens[seg_t] + (t - cu_q_lens[seg_t])  # [T] absolute position of each query
        mask = (seg_t[:, None] == seg_c[None, :]) & (pos_c[None, :] <= qpos[:, None]) & col_valid[None, :]
        if sliding_window is not None:
            mask &= pos_c[None, :] > qpos[:, None] - sliding_window
        qg = qf.reshape(T, K, R, H)
        s = _softcap(jnp.einsum("tkrh,kch->tkrc", qg, k), soft_cap)
        s = jnp.where(mask[:, None, None, :], s, _NEG)
        p = jax.nn.softmax(s, axis=-1)
        return jnp.einsum("tkrc,kch->tkrh", p, v).reshape(T, N, H)

    zeros = lambda: jnp.zeros((T, N, H), jnp.float32)  # noqa: E731
    dec = jax.lax.cond(jnp.any(is_decode), decode_path, zeros)
    pf = jax.lax.cond(jnp.any(is_prefill), prefill_path, zeros)
    use_dec = is_decode[seg_t] & row_valid
    use_pf = is_prefill[seg_t] & row_valid
    out = jnp.where(use_dec[:, None, None], dec, jnp.where(use_pf[:, None, None], pf, 0.0))
    return out.astype(q.dtype)
