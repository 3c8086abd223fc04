"""The packed matmul's bfloat16 variant (kernels_pallas/cpu/gemm.py, gemm.cc's *Bf16 handlers): bf16 panels of
k-pairs, bf16 x, float32 sums. Results against the pure-jnp reference (a bf16 x bf16 -> f32 dot at full precision)
and against float64 sums of the same bf16 values, a row's result bitwise independent of its batch and of the thread
count, valid_rows, the fused argmax and the errors. The tests taking `cpu_build` run against the default build
(vdpbf16ps where the CPU has AVX512-BF16) and the portable one (conftest.py)."""

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.cpu import gemm as cpu_gemm
from kernels_pallas.cpu import library

needs_kernel = pytest.mark.skipif(
    not cpu_gemm.available(), reason=f"FFI kernel unavailable: {cpu_gemm.unavailable_reason()}"
)


def operands(rng, M, K, N, lead=None):
    x = rng.standard_normal((*(lead or (M,)), K), np.float32).astype(jnp.bfloat16)
    w = rng.standard_normal((K, N), np.float32).astype(jnp.bfloat16)
    return x, w


def exact(x, w):
    """float64 sums of the bf16 products (each product is exact in float32 too)."""
    return np.asarray(x, np.float64) @ np.asarray(w, np.float64)


def test_pack_weight_bf16_layout_and_round_trip():
    K, N = 5, 70  # K odd: the last pair's second row is zero padding
    w = (np.arange(K * N, dtype=np.float32) / 8).reshape(K, N).astype(jnp.bfloat16)
    wp = cpu_gemm.pack_weight(w)
    assert wp.shape == (3, 3, cpu_gemm.NR, 2) and wp.dtype == jnp.bfloat16 and wp.flags.c_contiguous
    assert cpu_gemm.is_bf16(wp) and not cpu_gemm.is_bf16(cpu_gemm.pack_weight(np.asarray(w, np.float32)))
    np.testing.assert_array_equal(wp[1, 1, :, 0], w[2, 32:64])  # panel p, pair kk, column j, t: w[2kk + t, 32p + j]
    np.testing.assert_array_equal(wp[1, 1, :, 1], w[3, 32:64])
    assert not np.asarray(wp[:, 2, :, 1], np.float32).any()  # k = 5 is padding
    assert not np.asarray(wp[2, :, 6:], np.float32).any()  # zero padding past N
    np.testing.assert_array_equal(np.asarray(cpu_gemm.unpack_weight(jnp.asarray(wp), N, K)), w)
    assert cpu_gemm.unpack_weight(jnp.asarray(wp), N).shape == (6, N)  # without k: 2 ceil(K / 2) rows
    with pytest.raises(ValueError, match="float32 or bfloat16 \\[K, N\\]"):
        cpu_gemm.pack_weight(np.asarray(w, np.float16))


def test_the_native_build_has_the_bf16_dot_product_where_the_cpu_does():
    """`features()["avx512bf16"]`: the vdpbf16ps path is compiled in exactly when -march=native offers it (a CPU
    with AVX512-BF16 that silently ran the portable loop would be slow, not wrong)."""
    if not cpu_gemm.available():
        pytest.skip(f"FFI kernel unavailable: {cpu_gemm.unavailable_reason()}")
    if library.build_options():
        pytest.skip(f"a {library.BUILD_ENV_VAR} variant is loaded")
    try:
        flags = next(l for l in pathlib.Path("/proc/cpuinfo").read_text().splitlines() if l.startswith("flags"))
    except (OSError, StopIteration):
        pytest.skip("no /proc/cpuinfo flags")
    assert library.features()["avx512bf16"] == ("avx512_bf16" in flags.split())


@needs_kernel
@pytest.mark.parametrize(
    "M,K,N",
    [
        (1, 1, 1),  # K = 1: one pair, its second half padding
        (1, 64, 32),
        (3, 17, 33),  # K odd, N one past a panel
        (12, 128, 64),  # one full register block
        (13, 96, 31),
        (25, 255, 96),  # wide blocks (6 rows x 2 panels), a lone last panel, K odd
        (40, 96, 600),  # big enough for a helper thread
        (300, 2048, 40),  # several row chunks
    ],
)
def test_matches_the_reference(cpu_build, M, K, N):
    x, w = operands(np.random.default_rng(M * 1000 + K + N), M, K, N)
    wp = cpu_gemm.pack_weight(w)
    got = np.asarray(cpu_gemm.packed_matmul(x, wp, N))
    assert got.shape == (M, N) and got.dtype == np.float32
    # float32 sums of K exact products of N(0, 1)-sized bf16 terms: error ~ eps_f32 * sqrt(K) * |terms|
    tol = dict(rtol=1e-5, atol=1e-5 * np.sqrt(K) * 4)
    np.testing.assert_allclose(got, exact(x, w), **tol)
    np.testing.assert_allclose(got, np.asarray(cpu_gemm.reference_packed_matmul(x, wp, N)), **tol)
    # what a bf16 nnx.Linear computes: x and w in bf16, float32 sums
    np.testing.assert_allclose(got, np.asarray(jnp.dot(x, w, preferred_element_type=jnp.float32)), **tol)


@needs_kernel
def test_leading_dims_jit_and_argmax(cpu_build):
    """Leading dims and jit; the fused argmax picks jnp.argmax's column of the (bitwise equal) product, ties to the
    first column across panel groups, rows past valid_rows get 0."""
    M, K, N = 30, 64, 1000
    x, w = operands(np.random.default_rng(4), M, K, N)
    w = np.asarray(w).copy()
    w[:, 900:] = w[:, 100:200]  # ties across panel groups go to the earlier column
    x = np.asarray(x).copy()
    x[3] = 0  # every column ties: column 0
    wp = jnp.asarray(cpu_gemm.pack_weight(w))
    y = np.asarray(cpu_gemm.packed_matmul(x, wp, N))
    got = jax.jit(lambda x, wp: cpu_gemm.packed_matmul(x, wp, N))(x.reshape(5, 6, K), wp)
    np.testing.assert_array_equal(np.asarray(got).reshape(M, N), y)
    am = np.asarray(cpu_gemm.packed_matmul_argmax(x, wp, N, num_threads=2))
    np.testing.assert_array_equal(am, np.argmax(y, axis=-1))
    np.testing.assert_array_equal(am, np.asarray(cpu_gemm.packed_matmul_argmax(x, wp, N, num_threads=1)))
    assert am[3] == 0
    got = np.asarray(jax.jit(lambda x, r: cpu_gemm.packed_matmul_argmax(x, wp, N, valid_rows=r))(x, np.int32(17)))
    np.testing.assert_array_equal(got[:17], am[:17])
    np.testing.assert_array_equal(got[17:], 0)


@needs_kernel
def test_a_rows_result_is_bitwise_independent_of_batch_and_threads(cpu_build):
    """Each output element is one chain over the k-pairs in order, as for float32."""
    M, K, N = 64, 321, 200
    x, w = operands(np.random.default_rng(2), M, K, N)
    wp = jnp.asarray(cpu_gemm.pack_weight(w))
    full = np.asarray(cpu_gemm.packed_matmul(x, wp, N, num_threads=2))
    np.testing.assert_array_equal(full, np.asarray(cpu_gemm.packed_matmul(x, wp, N, num_threads=1)))
    for rows in ([0], [5], [63], [10, 11, 12], list(range(20, 37))):
        np.testing.assert_array_equal(np.asarray(cpu_gemm.packed_matmul(x[rows], wp, N)), full[rows])


@needs_kernel
def test_valid_rows_computes_the_leading_rows_and_zeros_the_rest(cpu_build):
    M, K, N = 40, 96, 70
    x, w = operands(np.random.default_rng(3), M, K, N)
    wp = jnp.asarray(cpu_gemm.pack_weight(w))
    full = np.asarray(cpu_gemm.packed_matmul(x, wp, N))
    run = jax.jit(lambda x, r: cpu_gemm.packed_matmul(x, wp, N, valid_rows=r))
    for valid in (0, 13, 40):
        poisoned = np.asarray(x).copy()
        poisoned[valid:] = np.nan
        got = np.asarray(run(poisoned, np.int32(valid)))
        np.testing.assert_array_equal(got[:valid], full[:valid])
        np.testing.assert_array_equal(got[valid:], 0.0)


def test_bad_shapes_and_dtypes_are_refused():
    x = np.ones((4, 16), jnp.bfloat16)
    wp = cpu_gemm.pack_weight(np.ones((16, 40), jnp.bfloat16))  # 2 panels, 8 pairs
    with pytest.raises(ValueError, match="bfloat16 weights takes bfloat16 x"):
        cpu_gemm.packed_matmul(x.astype(np.float32), wp, 40)
    with pytest.raises(ValueError, match="float32 \\(or bfloat16\\) x and weights"):
        cpu_gemm.packed_matmul(x, cpu_gemm.pack_weight(np.ones((16, 40), np.float32)), 40)
    with pytest.raises(ValueError, match="last dim 14 does not fit"):
        cpu_gemm.packed_matmul(x[:, :14], wp, 40)
    with pytest.raises(ValueError, match="2 panels, n = 70 needs"):
        cpu_gemm.packed_matmul(x, wp, 70)
    with pytest.raises(ValueError, match="packed bf16 weights"):
        cpu_gemm.packed_matmul(x, wp[..., :1], 40)
