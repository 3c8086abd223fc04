"""int8 KV pages on the CPU paths: the XLA ragged attention (XLA loops, C++ decode rows, C++ for all rows) and
the C++ decode kernel alone (the prefill kernel alone: test_cpu_prefill_attention.py), against the naive float64
attention over the dequantized pages (kernels_pallas/kv_quant.py).

Unused rows hold random int8 and NaN scales: dequantized, they are NaN, so a path that reads them fails."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import kv_quant
from kernels_pallas.cpu import attention as cpu_attention
from kernels_pallas.xla_attention import xla_ragged_paged_attention
from tests.kernels.test_cpu_decode_attention import decode_case, decode_rows, needs_kernel
from tests.kernels.test_xla_attention import CASES, make_case, naive

BLOCKS = dict(slot_block=2, decode_kv_block=16, prefill_kv_block=32, q_block=8)


def quantize_case(rng, args):
    """make_case's float args -> (int8 args with k_scales / v_scales, the dequantized float pages for `naive`)."""
    q, k_pages, v_pages, *meta = args
    out, dequantized = [], []
    for pages in (k_pages, v_pages):
        live = np.isfinite(pages).all(axis=-1, keepdims=True)  # [K, P, G, 1]
        qp, scale = (np.asarray(x) for x in kv_quant.quantize(jnp.asarray(np.nan_to_num(pages))))
        qp = np.where(live, qp, rng.integers(-128, 128, pages.shape)).astype(np.int8)
        scale = np.where(live, scale, np.nan).astype(np.float32)
        out.append((qp, scale))
        dequantized.append(qp.astype(np.float64) * scale)
    (kq, ks), (vq, vs) = out
    return (q, kq, vq, *meta), dict(k_scales=ks, v_scales=vs), dequantized


def check(got, want, args):
    assert np.all(np.isfinite(got)), "a NaN scale of an unused row reached the output"
    T_live = int(args[5][int(args[6][0])])
    np.testing.assert_allclose(got[:T_live], want[:T_live], atol=2e-5, rtol=2e-5)
    assert np.all(got[T_live:] == 0), "padding rows must be zero"


@pytest.mark.parametrize(
    "decode_impl,prefill_impl",
    [("xla", "xla"), pytest.param("ffi", "xla", marks=needs_kernel), pytest.param("ffi", "ffi", marks=needs_kernel)],
)
@pytest.mark.parametrize("name", ["mixed_decode_first", "mixed_interleaved", "long_prefill_many_blocks"])
@pytest.mark.parametrize("window,soft_cap", [(None, None), (6, 5.0)])
def test_ragged_int8_matches_naive_over_dequantized_pages(decode_impl, prefill_impl, name, window, soft_cap):
    rng = np.random.default_rng(sorted(CASES).index(name))
    args, scales, (k_deq, v_deq) = quantize_case(rng, make_case(rng, *CASES[name]))
    impls = dict(decode_impl=decode_impl, prefill_impl=prefill_impl)
    kw = dict(sliding_window=window, soft_cap=soft_cap, **impls, **BLOCKS, **scales)
    got = np.asarray(jax.jit(lambda *a: xla_ragged_paged_attention(*a, **kw))(*args))
    want = naive(args[0], k_deq, v_deq, *args[3:], window=window, soft_cap=soft_cap)
    check(got, want, args)


@needs_kernel
@pytest.mark.parametrize("H,R", [(64, 4), (32, 1), (32, 4), (40, 2)])  # 40: the generic (runtime H) path
@pytest.mark.parametrize("q_dtype", [jnp.float32, jnp.bfloat16])
def test_cpu_decode_kernel_int8(H, R, q_dtype):
    rng = np.random.default_rng(H + R)
    args, scales, (k_deq, v_deq) = quantize_case(rng, decode_case(H, K=2, N=2 * R, H=H))
    q = jnp.asarray(args[0], q_dtype)
    got = cpu_attention.cpu_decode_attention(q, *args[1:], **scales)
    assert got.dtype == q_dtype
    got = np.asarray(got, np.float32)
    assert np.all(np.isfinite(got))
    want = naive(np.asarray(q, np.float32), k_deq, v_deq, *args[3:])
    rows = decode_rows(args)
    tol = 2e-5 if q_dtype == jnp.float32 else 1e-2
    np.testing.assert_allclose(got[rows], want[rows], atol=tol, rtol=tol)


def test_quantize_round_trip_error_is_within_half_a_step():
    x = np.random.default_rng(0).standard_normal((50, 64)).astype(np.float32) * 3
    x[3] = 0.0  # an all-zero row: scale 0, dequantizes to exact zeros
    qp, scale = kv_quant.quantize(jnp.asarray(x))
    assert qp.dtype == jnp.int8 and scale.shape == (50, 1)
    assert int(jnp.min(qp)) >= -127
    back = np.asarray(kv_quant.dequantize(qp, scale))
    assert np.all(np.abs(back - x) <= np.asarray(scale) / 2 + 1e-6)
    assert np.all(back[3] == 0)


def test_bad_scales_are_rejected():
    rng = np.random.default_rng(1)
    args, scales, _ = quantize_case(rng, make_case(rng, [1, 3], [9, 3]))
    with pytest.raises(ValueError, match="need k_scales and v_scales"):
        xla_ragged_paged_attention(*args)
    with pytest.raises(ValueError, match="both or neither"):
        xla_ragged_paged_attention(*args, k_scales=scales["k_scales"])
    with pytest.raises(ValueError, match="shape"):
        xla_ragged_paged_attention(*args, k_scales=scales["k_scales"][..., 0], v_scales=scales["v_scales"])
    float_args = make_case(rng, [1, 3], [9, 3])
    with pytest.raises(ValueError, match="for int8 pages"):
        xla_ragged_paged_attention(*float_args, **scales)
