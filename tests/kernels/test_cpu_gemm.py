"""The packed-weight matmul for CPU (kernels_pallas/cpu/gemm.py, gemm.cc): packing, results against jnp.dot,
a row's result bitwise independent of its batch and of the thread count, and the errors it raises. The tests
taking `cpu_build` run against the default build and the portable one, without AVX-512 (conftest.py)."""

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
    x = rng.standard_normal((*(lead or (M,)), K), np.float32)
    w = rng.standard_normal((K, N), np.float32)
    return x, w


def test_kernel_builds_where_a_compiler_exists():
    """The other tests skip without a C++ compiler; with one, a failed build is a failure, not a skip."""
    if library.compiler_found():
        assert cpu_gemm.available(), cpu_gemm.unavailable_reason()


def test_pack_weight_layout_and_round_trip():
    w = np.arange(5 * 70, dtype=np.float32).reshape(5, 70)
    wp = cpu_gemm.pack_weight(w)
    assert wp.shape == (3, 5, cpu_gemm.NR) and wp.dtype == np.float32 and wp.flags.c_contiguous
    np.testing.assert_array_equal(wp[1, 2], w[2, 32:64])  # panel p, row k: columns p*NR .. p*NR + NR - 1
    assert not wp[2, :, 6:].any()  # zero padding past N
    np.testing.assert_array_equal(np.asarray(cpu_gemm.unpack_weight(jnp.asarray(wp), 70)), w)
    with pytest.raises(ValueError, match="float32 or bfloat16 \\[K, N\\]"):
        cpu_gemm.pack_weight(w.astype(np.float64))
    with pytest.raises(ValueError, match="float32 or bfloat16 \\[K, N\\]"):
        cpu_gemm.pack_weight(w[None])


@needs_kernel
@pytest.mark.parametrize(
    "M,K,N",
    [
        (1, 1, 1),
        (1, 64, 32),
        (3, 17, 33),  # K odd, N one past a panel
        (7, 64, 100),
        (12, 128, 64),  # one full register block
        (13, 96, 31),  # a block of 12 + 1 row would be lopsided: 7 + 6
        (16, 33, 65),
        (25, 256, 96),  # wide blocks (6 rows x 2 panels) and a lone last panel
        (40, 96, 600),  # big enough for a helper thread
        (300, 2048, 40),  # several row chunks (x's chunk sized to L2)
    ],
)
def test_matches_jnp_dot(cpu_build, M, K, N):
    x, w = operands(np.random.default_rng(M * 1000 + K + N), M, K, N)
    got = np.asarray(cpu_gemm.packed_matmul(x, cpu_gemm.pack_weight(w), N))
    want = x.astype(np.float64) @ w.astype(np.float64)
    assert got.shape == (M, N) and got.dtype == np.float32
    # float32 sums of K products of N(0, 1) terms: error ~ eps * sqrt(K) * |terms|
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.sqrt(K) * 4)
    np.testing.assert_allclose(got, np.asarray(jnp.dot(x, w)), rtol=1e-5, atol=1e-5 * np.sqrt(K) * 4)


@needs_kernel
def test_leading_dims_and_jit(cpu_build):
    x, w = operands(np.random.default_rng(1), None, 48, 70, lead=(2, 3, 5))
    wp = jnp.asarray(cpu_gemm.pack_weight(w))
    got = jax.jit(lambda x, wp: cpu_gemm.packed_matmul(x, wp, 70))(x, wp)
    assert got.shape == (2, 3, 5, 70)
    want = cpu_gemm.reference_packed_matmul(x, wp, 70)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-4)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(cpu_gemm.packed_matmul(x, wp, 70)))  # jit or not


@needs_kernel
def test_a_rows_result_is_bitwise_independent_of_batch_and_threads(cpu_build):
    """Each output element is one fma chain over k in order: the row's block size and place, M and the thread
    count change nothing (the engine's exactness tests compare a batch against separate forwards)."""
    # 64 rows: register blocks of 6 rows x 2 panels; the subsets below (<= 24 rows): blocks of up to 12 rows x 1
    # panel. M * K * N is enough for a helper thread.
    M, K, N = 64, 320, 200
    x, w = operands(np.random.default_rng(2), M, K, N)
    wp = jnp.asarray(cpu_gemm.pack_weight(w))
    full = np.asarray(cpu_gemm.packed_matmul(x, wp, N, num_threads=2))
    np.testing.assert_array_equal(full, np.asarray(cpu_gemm.packed_matmul(x, wp, N, num_threads=1)))
    for rows in ([0], [5], [63], [10, 11, 12], list(range(20, 37))):
        np.testing.assert_array_equal(np.asarray(cpu_gemm.packed_matmul(x[rows], wp, N)), full[rows])


@needs_kernel
def test_valid_rows_computes_the_leading_rows_and_zeros_the_rest(cpu_build):
    """A padded batch's rows from valid_rows on are zeros (even where x holds NaN there); the rows before are
    bitwise those of the full call. Out-of-range counts clamp to [0, M]; a traced count works under jit."""
    M, K, N = 40, 96, 70
    x, w = operands(np.random.default_rng(3), M, K, N)
    wp = jnp.asarray(cpu_gemm.pack_weight(w))
    full = np.asarray(cpu_gemm.packed_matmul(x, wp, N))
    run = jax.jit(lambda x, r: cpu_gemm.packed_matmul(x, wp, N, valid_rows=r))
    for valid in (0, 1, 13, 39, 40):
        poisoned = np.asarray(x).copy()
        poisoned[valid:] = np.nan
        got = np.asarray(run(poisoned, np.int32(valid)))
        np.testing.assert_array_equal(got[:valid], full[:valid])
        np.testing.assert_array_equal(got[valid:], 0.0)
        want = cpu_gemm.reference_packed_matmul(np.nan_to_num(poisoned), wp, N, valid_rows=valid)
        np.testing.assert_allclose(got, np.asarray(want), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(run(x, np.int32(-3))), 0.0)
    np.testing.assert_array_equal(np.asarray(run(x, np.int32(M + 5))), full)
    # Leading dims: the count is over the flattened rows.
    got = np.asarray(cpu_gemm.packed_matmul(np.asarray(x).reshape(4, 10, K), wp, N, valid_rows=np.array([25])))
    np.testing.assert_array_equal(got.reshape(M, N)[:25], full[:25])
    np.testing.assert_array_equal(got.reshape(M, N)[25:], 0.0)


@needs_kernel
def test_empty_operands(cpu_build):
    wp = cpu_gemm.pack_weight(np.ones((8, 40), np.float32))
    assert cpu_gemm.packed_matmul(np.ones((0, 8), np.float32), wp, 40).shape == (0, 40)
    got = cpu_gemm.packed_matmul(np.ones((3, 0), np.float32), cpu_gemm.pack_weight(np.ones((0, 5), np.float32)), 5)
    np.testing.assert_array_equal(np.asarray(got), np.zeros((3, 5), np.float32))


def test_bad_shapes_and_dtypes_are_refused():
    x = np.ones((4, 16), np.float32)
    wp = cpu_gemm.pack_weight(np.ones((16, 40), np.float32))  # 2 panels
    with pytest.raises(ValueError, match="float32"):
        cpu_gemm.packed_matmul(x.astype(jnp.bfloat16), wp, 40)
    with pytest.raises(ValueError, match="float32"):
        cpu_gemm.packed_matmul(x, wp.astype(np.float16), 40)
    with pytest.raises(ValueError, match="last dim 15 differs"):
        cpu_gemm.packed_matmul(x[:, :15], wp, 40)
    with pytest.raises(ValueError, match="2 panels, n = 70 needs"):
        cpu_gemm.packed_matmul(x, wp, 70)
    with pytest.raises(ValueError, match="packed weights \\[P, K, 32\\]"):
        cpu_gemm.packed_matmul(x, wp[..., :16], 40)
    with pytest.raises(ValueError, match="packed weights \\[P, K, 32\\]"):
        cpu_gemm.packed_matmul(x, np.ones((16, 40), np.float32), 40)
    with pytest.raises(ValueError, match="n must be"):
        cpu_gemm.packed_matmul(x, wp, -1)
    with pytest.raises(ValueError, match="n must be"):
        cpu_gemm.packed_matmul(x, wp, 40.0)


@needs_kernel
def test_argmax_is_the_argmax_of_the_matmul(cpu_build):
    """packed_matmul_argmax picks jnp.argmax's column of packed_matmul's (bitwise equal) product: ties go to the
    first column (across panels and panel groups), a NaN wins (the first one), columns past N never win, rows past
    valid_rows get 0; bitwise the same with 1 or 2 threads."""
    M, K, N = 30, 64, 1000  # 32 panels: 8 panel groups of work items
    x, w = operands(np.random.default_rng(4), M, K, N)
    w = np.asarray(w).copy()
    w[:, 900:] = w[:, 100:200]  # columns 900.. repeat 100..199: every tie across groups goes to the earlier one
    x = np.asarray(x).copy()
    x[3] = 0.0  # all-zero row: every column ties, column 0 wins
    x[4] = -1e30  # huge values: +-inf in the product
    wp = jnp.asarray(cpu_gemm.pack_weight(w))
    y = np.asarray(cpu_gemm.packed_matmul(x, wp, N))
    got = np.asarray(cpu_gemm.packed_matmul_argmax(x, wp, N, num_threads=2))
    np.testing.assert_array_equal(got, np.argmax(y, axis=-1))
    np.testing.assert_array_equal(got, np.asarray(cpu_gemm.packed_matmul_argmax(x, wp, N, num_threads=1)))
    # NaN: the first NaN column wins (as jnp.argmax).
    w_nan = w.copy()
    w_nan[:, 777] = np.nan
    w_nan[:, 5] = np.where(np.arange(K) == 0, np.nan, w_nan[:, 5])  # NaN in column 5 only through x's column 0
    wp_nan = jnp.asarray(cpu_gemm.pack_weight(w_nan))
    y_nan = np.asarray(cpu_gemm.packed_matmul(x, wp_nan, N))
    np.testing.assert_array_equal(
        np.asarray(cpu_gemm.packed_matmul_argmax(x, wp_nan, N)), np.asarray(jnp.argmax(y_nan, axis=-1))
    )
    # N not a multiple of 32: the zero-padded columns never win, even over all-negative real columns.
    n_odd = 37
    w_neg = -np.abs(w[:, :n_odd]) - 1.0
    x_pos = np.abs(x) + 0.1
    got = cpu_gemm.packed_matmul_argmax(x_pos, cpu_gemm.pack_weight(w_neg), n_odd)
    np.testing.assert_array_equal(np.asarray(got), np.argmax(x_pos @ w_neg, axis=-1))
    # valid_rows under jit, and leading dims.
    run = jax.jit(lambda x, r: cpu_gemm.packed_matmul_argmax(x, wp, N, valid_rows=r))
    got = np.asarray(run(x, np.int32(17)))
    np.testing.assert_array_equal(got[:17], np.argmax(y, axis=-1)[:17])
    np.testing.assert_array_equal(got[17:], 0)
    got = cpu_gemm.packed_matmul_argmax(x.reshape(5, 6, K), wp, N)
    np.testing.assert_array_equal(np.asarray(got).reshape(M), np.argmax(y, axis=-1))
    with pytest.raises(ValueError, match="n >= 1"):
        cpu_gemm.packed_matmul_argmax(x[:, :0], cpu_gemm.pack_weight(np.ones((0, 0), np.float32)), 0)
