"""The pure-jnp references against a naive float64 loop over contiguous KV.

The kernels are only as trustworthy as the references they are compared to,
so the references are checked here against the most literal attention there
is: per query and head, a softmax over the gathered contiguous context,
computed in float64 numpy with Python loops. With int8 pages that context is
the dequantized rows the cache builder filled the pages from.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.paged_attention import reference_paged_attention
from kernels_pallas.ragged_paged_attention import reference_ragged_paged_attention
from tests.kernels.kv_cache_builder import build_paged_kv, ragged_metadata

_ref_decode = jax.jit(reference_paged_attention, static_argnames=("sm_scale", "soft_cap", "sliding_window"))
_ref_ragged = jax.jit(reference_ragged_paged_attention, static_argnames=("sm_scale", "soft_cap", "sliding_window"))


def naive_attention(q, q_pos, k_ctx, v_ctx, *, sm_scale, soft_cap, window):
    """q [M, N, H] at absolute positions q_pos [M]; k_ctx, v_ctx [L, K, H]."""
    num_q, num_heads, head_dim = q.shape
    group = num_heads // k_ctx.shape[1]
    out = np.zeros((num_q, num_heads, head_dim))
    for m in range(num_q):
        lo = 0 if window is None else max(0, q_pos[m] - window + 1)
        visible = range(lo, q_pos[m] + 1)
        if not visible:
            continue
        for n in range(num_heads):
            kv_head = n // group
            scores = np.array([q[m, n] @ k_ctx[p, kv_head] for p in visible]) * sm_scale
            if soft_cap is not None:
                scores = soft_cap * np.tanh(scores / soft_cap)
            weights = np.exp(scores - scores.max())
            weights /= weights.sum()
            out[m, n] = sum(w * v_ctx[p, kv_head] for w, p in zip(weights, visible))
    return out


OPTIONS = [
    dict(sm_scale=None, soft_cap=None, sliding_window=None),
    dict(sm_scale=0.3, soft_cap=2.0, sliding_window=None),
    dict(sm_scale=None, soft_cap=None, sliding_window=5),
]


@pytest.mark.parametrize("quantize", [False, True], ids=["float", "int8"])
@pytest.mark.parametrize("options", OPTIONS)
def test_decode_reference_matches_naive(options, quantize):
    rng = np.random.default_rng(0)
    page_size, head_dim, pages_per_seq = 4, 16, 3
    kv_lens = [0, 1, 3, 4, 5, 12]
    cache = build_paged_kv(
        rng,
        kv_lens,
        num_kv_heads=2,
        page_size=page_size,
        head_dim=head_dim,
        pages_per_seq=pages_per_seq,
        dtype=jnp.float32,
        quantize=quantize,
    )
    q = rng.standard_normal((len(kv_lens), 8, head_dim)).astype(np.float32)
    args = (jnp.asarray(q), cache.k_pages, cache.v_pages, cache.kv_lens, cache.page_indices)
    got = _ref_decode(*args, **options, **cache.scales)
    scale = options["sm_scale"] or head_dim**-0.5
    for b, length in enumerate(kv_lens):
        want = naive_attention(
            q[b : b + 1].astype(np.float64),
            [length - 1],
            cache.k_seqs[b],
            cache.v_seqs[b],
            sm_scale=scale,
            soft_cap=options["soft_cap"],
            window=options["sliding_window"],
        )
        np.testing.assert_allclose(
            np.asarray(got[b : b + 1]), want, atol=2e-6, err_msg=f"sequence {b}, kv_len {length}"
        )


@pytest.mark.parametrize("quantize", [False, True], ids=["float", "int8"])
@pytest.mark.parametrize("options", OPTIONS)
def test_ragged_reference_matches_naive(options, quantize):
    rng = np.random.default_rng(1)
    page_size, head_dim, pages_per_seq = 4, 16, 3
    # Empty slot, decode, full prefill, chunked prefill, then an ignored slot.
    kv_lens = [0, 5, 6, 12, 7]
    q_lens = [0, 1, 6, 5, 2]
    num_seqs, num_tokens = 4, 16
    cache = build_paged_kv(
        rng,
        kv_lens,
        num_kv_heads=2,
        page_size=page_size,
        head_dim=head_dim,
        pages_per_seq=pages_per_seq,
        dtype=jnp.float32,
        quantize=quantize,
    )
    cu, num = ragged_metadata(q_lens, num_seqs, len(kv_lens), rng)
    q = rng.standard_normal((num_tokens, 4, head_dim)).astype(np.float32)
    args = (jnp.asarray(q), cache.k_pages, cache.v_pages, cache.kv_lens, cache.page_indices, cu, num)
    got = np.asarray(_ref_ragged(*args, **options, **cache.scales))
    scale = options["sm_scale"] or head_dim**-0.5
    cu = np.asarray(cu)
    for i in range(num_seqs):
        rows = slice(cu[i], cu[i + 1])
        q_pos = kv_lens[i] - q_lens[i] + np.arange(q_lens[i])
        want = naive_attention(
            q[rows].astype(np.float64),
            q_pos,
            cache.k_seqs[i],
            cache.v_seqs[i],
            sm_scale=scale,
            soft_cap=options["soft_cap"],
            window=options["sliding_window"],
        )
        np.testing.assert_allclose(got[rows], want, atol=2e-6, err_msg=f"sequence {i}")
    assert np.all(got[cu[num_seqs] :] == 0), "padding rows must be zeros"


def test_ragged_reference_with_one_token_each_is_decode_reference():
    # Two independently written references agree where their contracts meet.
    rng = np.random.default_rng(2)
    kv_lens = [1, 7, 8, 9, 16, 3]
    cache = build_paged_kv(rng, kv_lens, num_kv_heads=2, page_size=8, head_dim=32, pages_per_seq=2, dtype=jnp.float32)
    q = jnp.asarray(rng.standard_normal((len(kv_lens), 8, 32)), jnp.float32)
    cu, num = ragged_metadata([1] * len(kv_lens), len(kv_lens), len(kv_lens))
    decode = _ref_decode(
        q, cache.k_pages, cache.v_pages, cache.kv_lens, cache.page_indices, sliding_window=4, soft_cap=3.0
    )
    ragged = _ref_ragged(
        q, cache.k_pages, cache.v_pages, cache.kv_lens, cache.page_indices, cu, num, sliding_window=4, soft_cap=3.0
    )
    np.testing.assert_allclose(np.asarray(ragged), np.asarray(decode), atol=1e-6)


@pytest.mark.parametrize("reference", [reference_paged_attention, reference_ragged_paged_attention])
def test_references_refuse_int8_pages_without_scales(reference):
    # Without the check a reference would attend to the raw integers and the kernels would be tested against that.
    cache = build_paged_kv(
        np.random.default_rng(3),
        [5],
        num_kv_heads=2,
        page_size=4,
        head_dim=16,
        pages_per_seq=2,
        dtype=None,
        quantize=True,
    )
    q = jnp.zeros((1, 2, 16), jnp.float32)
    meta = () if reference is reference_paged_attention else ragged_metadata([1], 1, 1)
    with pytest.raises(ValueError, match="int8 pages need k_scales and v_scales"):
        reference(q, cache.k_pages, cache.v_pages, cache.kv_lens, cache.page_indices, *meta)
