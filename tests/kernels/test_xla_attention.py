"""The XLA ragged paged attention (the CPU backend's fallback without a C++ compiler) against a naive
per-sequence dense attention. Both halves are forced onto the XLA loops (XLA_ONLY): by default the CPU backend
runs the C++ kernel (tested in test_cpu_decode_attention.py and test_cpu_prefill_attention.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.xla_attention import xla_ragged_paged_attention

XLA_ONLY = dict(decode_impl="xla", prefill_impl="xla")


def naive(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, window=None, soft_cap=None):
    q, k_pages, v_pages = (np.asarray(x, np.float64) for x in (q, k_pages, v_pages))
    _T, N, H = q.shape
    K, _, G, _ = k_pages.shape
    out = np.zeros_like(q)
    for i in range(int(num_seqs[0])):
        a, b = cu_q_lens[i], cu_q_lens[i + 1]
        L = kv_lens[i]
        pos = np.arange(L)
        k = k_pages[:, page_indices[i, pos // G], pos % G]  # [K, L, H]
        v = v_pages[:, page_indices[i, pos // G], pos % G]
        for j, t in enumerate(range(a, b)):
            qp = L - (b - a) + j
            for n in range(N):
                s = k[n // (N // K)] @ q[t, n] / np.sqrt(H)
                if soft_cap is not None:
                    s = soft_cap * np.tanh(s / soft_cap)
                ok = pos <= qp
                if window is not None:
                    ok &= pos > qp - window
                s = np.where(ok, s, -np.inf)
                p = np.exp(s - s.max())
                out[t, n] = (p / p.sum()) @ v[n // (N // K)]
    return out


def make_case(rng, q_lens, kv_lens, K=2, N=8, H=16, G=8, extra_slots=2, extra_tokens=5):
    S = len(q_lens) + extra_slots
    W = max(-(-max(kv_lens) // G), 1) + 1
    P = S * W + 3
    k_pages = np.full((K, P, G, H), np.nan, np.float32)  # NaN everywhere a live token is not
    v_pages = np.full((K, P, G, H), np.nan, np.float32)
    perm = rng.permutation(P)
    page_indices = np.zeros((S, W), np.int32)
    for i, L in enumerate(kv_lens):
        page_indices[i] = perm[i * W : (i + 1) * W]
        for p in range(L):
            pg, off = page_indices[i, p // G], p % G
            k_pages[:, pg, off] = rng.standard_normal((K, H))
            v_pages[:, pg, off] = rng.standard_normal((K, H))
    T = sum(q_lens) + extra_tokens
    q = rng.standard_normal((T, N, H)).astype(np.float32)
    cu = np.zeros(S + 1, np.int32)
    cu[1 : len(q_lens) + 1] = np.cumsum(q_lens)
    cu[len(q_lens) + 1 :] = cu[len(q_lens)]
    kv = np.zeros(S, np.int32)
    kv[: len(kv_lens)] = kv_lens
    return q, k_pages, v_pages, kv, page_indices, cu, np.array([len(q_lens)], np.int32)


CASES = {
    "decode_only": ([1] * 5, [1, 7, 8, 9, 40]),
    "prefill_only": ([5, 17, 3], [5, 30, 3]),
    "mixed_decode_first": ([1, 1, 1, 12, 6], [9, 16, 33, 12, 20]),
    "mixed_interleaved": ([4, 1, 9, 1, 2], [4, 50, 25, 1, 2]),
    "empty_slot_in_the_middle": ([1, 0, 6], [3, 0, 6]),
    "long_prefill_many_blocks": ([70, 1], [300, 129]),
}


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("window,soft_cap", [(None, None), (6, None), (None, 5.0)])
def test_matches_naive_attention_and_ignores_nan_padding(name, window, soft_cap):
    rng = np.random.default_rng(abs(hash(name)) % 2**31)
    q_lens, kv_lens = CASES[name]
    args = make_case(rng, q_lens, kv_lens)
    got = np.asarray(
        jax.jit(
            lambda *a: xla_ragged_paged_attention(
                *a,
                sliding_window=window,
                soft_cap=soft_cap,
                slot_block=2,
                decode_kv_block=16,
                prefill_kv_block=32,
                q_block=8,
                **XLA_ONLY,
            )
        )(*args)
    )
    want = naive(*args, window=window, soft_cap=soft_cap)
    assert np.all(np.isfinite(got)), "NaN from an unused page reached the output"
    T_live = int(args[5][int(args[6][0])])
    np.testing.assert_allclose(got[:T_live], want[:T_live], atol=2e-5, rtol=2e-5)
    assert np.all(got[T_live:] == 0), "padding rows must be zero"


def test_bfloat16_inputs_close_to_float32():
    rng = np.random.default_rng(3)
    args = make_case(rng, [1, 1, 9], [20, 3, 9])
    q, k, v = (np.nan_to_num(x) for x in args[:3])
    f32 = np.asarray(xla_ragged_paged_attention(q, k, v, *args[3:], **XLA_ONLY))
    bf = xla_ragged_paged_attention(
        jnp.asarray(q, jnp.bfloat16), jnp.asarray(k, jnp.bfloat16), jnp.asarray(v, jnp.bfloat16), *args[3:], **XLA_ONLY
    )
    assert bf.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(bf, np.float32), f32, atol=3e-2, rtol=3e-2)
