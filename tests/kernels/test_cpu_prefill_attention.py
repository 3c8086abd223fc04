"""The C++ FFI attention for CPU on prefill rows (kernels_pallas/cpu/prefill_attention.cc via cpu/attention.py),
alone and inside the XLA ragged path (prefill_impl="ffi"), against the naive float64 attention: mixed batches of
decodes, fresh prompts, chunks after earlier context and padding rows, over GQA ratios, head dims, page sizes,
sliding window, soft cap, bf16 and int8 pages; NaN in unused pages and garbage page tables never reach an
output. The tests taking `cpu_build` run against the default build and the portable one, without AVX-512
(conftest.py)."""

import pathlib
import tomllib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.cpu import attention as cpu_attention
from kernels_pallas.cpu import library
from kernels_pallas.xla_attention import xla_ragged_paged_attention
from tests.kernels.kv_cache_builder import ragged_metadata
from tests.kernels.test_cpu_decode_attention import naive, needs_kernel, poison_page_table
from tests.kernels.test_int8_kv_cpu import quantize_case
from tests.kernels.test_xla_attention import make_case


def mixed_case(seed, *, K=2, N=8, H=32, G=16, long=False):
    """Decodes, fresh prompts (kv_len = q_len), chunks after earlier context (kv_len > q_len), an empty slot, a
    2-token verify-like chunk; with `long`, a prompt and a chunk that span several row blocks and context blocks.
    Padding rows after the last sequence, NaN in unused pages and page tails, garbage past the used table."""
    q_lens = [1, 7, 1, 0, 20, 2, 1]
    kv_lens = [30, 7, 3, 0, 3 * G + 21, 2 * G + 2, G]
    if long:
        q_lens += [150, 90]
        kv_lens += [150, 260]
    rng = np.random.default_rng(seed)
    return poison_page_table(rng, make_case(rng, q_lens, kv_lens, K=K, N=N, H=H, G=G), G)


def live_rows(args, want_len):
    """Rows of live sequences whose q_len satisfies `want_len`."""
    cu, num_seqs = args[5], int(args[6][0])
    return [r for i in range(num_seqs) if want_len(cu[i + 1] - cu[i]) for r in range(cu[i], cu[i + 1])]


def check(got, args, rows, atol=2e-5, **kw):
    got = np.asarray(got, np.float32)
    want = naive(*args, **kw)
    assert np.all(np.isfinite(got)), "NaN from an unused page reached the output"
    np.testing.assert_allclose(got[rows], want[rows], atol=atol, rtol=atol)
    others = np.setdiff1d(np.arange(got.shape[0]), rows)
    assert np.all(got[others] == 0), "rows outside the filled kind (and padding) must be zero"


def kernel(args, rows="both", window=None, soft_cap=None, **kw):
    fn = lambda *a: cpu_attention.cpu_ragged_attention(*a, rows=rows, sliding_window=window, soft_cap=soft_cap, **kw)
    return np.asarray(jax.jit(fn)(*args))


@needs_kernel
@pytest.mark.parametrize(
    "K,N,H",
    [(2, 8, 32), (4, 16, 64), (2, 4, 16), (1, 1, 128), (1, 8, 64), (1, 3, 40)],  # tiny, small, test-tiny, ...
)
def test_mixed_batch_matches_naive_gqa_and_head_dims(cpu_build, K, N, H):
    args = mixed_case(K * 100 + N * 10 + H, K=K, N=N, H=H, long=True)
    check(kernel(args), args, live_rows(args, lambda n: n >= 1))


@needs_kernel
@pytest.mark.parametrize("G", [8, 16, 32])
@pytest.mark.parametrize("window,soft_cap", [(None, None), (1, None), (6, None), (70, None), (None, 5.0), (9, 3.0)])
def test_page_sizes_window_soft_cap(cpu_build, G, window, soft_cap):
    args = mixed_case(G, G=G)
    check(kernel(args, window=window, soft_cap=soft_cap), args, live_rows(args, lambda n: n >= 1), window=window,
          soft_cap=soft_cap)  # fmt: skip


@needs_kernel
def test_rows_selects_the_kind_and_both_is_their_sum(cpu_build):
    args = mixed_case(3, long=True)
    pre, dec, both = (kernel(args, rows=r) for r in ("prefill", "decode", "both"))
    check(pre, args, live_rows(args, lambda n: n > 1))
    check(dec, args, live_rows(args, lambda n: n == 1))
    np.testing.assert_array_equal(both, pre + dec)  # each row is computed once, the same way


@needs_kernel
def test_sequences_past_num_seqs_and_garbage_metadata_are_ignored(cpu_build):
    rng = np.random.default_rng(8)
    q, k, v, kv, pt, cu, _ = args = mixed_case(8, long=True)
    live = 5  # sequences 5.. look like prefills (and the padding) but are past num_seqs
    got = kernel((q, k, v, kv, pt, cu, np.array([live], np.int32)))
    want = naive(q, k, v, kv, pt, cu, np.array([live]))
    end = int(cu[live])
    np.testing.assert_allclose(got[:end], want[:end], atol=2e-5, rtol=2e-5)
    assert np.all(got[end:] == 0)
    # cu_q_lens past num_seqs and the kv_lens / page rows of dead sequences hold garbage: ignored.
    cu_bad, _ = ragged_metadata(np.diff(cu), live, len(cu) - 1, rng)
    kv_bad, pt_bad = kv.copy(), pt.copy()
    kv_bad[live:] = rng.integers(-5, 10**6, len(kv) - live)
    pt_bad[live:] = rng.integers(-(2**31), 2**31 - 1, pt[live:].shape)
    got_bad = kernel((q, k, v, kv_bad, pt_bad, np.asarray(cu_bad), np.array([live], np.int32)))
    np.testing.assert_array_equal(got_bad, got)
    del args


@needs_kernel
def test_queries_past_their_context_give_zeros_not_nan(cpu_build):
    """Out of contract (q_len > kv_len): the rows that would sit at negative positions stay zero, the rest attend."""
    rng = np.random.default_rng(4)
    q, k, v, kv, pt, cu, ns = make_case(rng, [6, 3], [6, 9])
    kv_short = kv.copy()
    kv_short[0] = 4  # rows 0, 1 of sequence 0 would sit at positions -2, -1
    got = kernel((q, k, v, kv_short, pt, cu, ns))
    assert np.all(np.isfinite(got)) and np.all(got[:2] == 0)
    want = naive(q[2:6], k, v, kv_short[:1], pt[:1], np.array([0, 4]), np.array([1]))
    np.testing.assert_allclose(got[2:6], want, atol=2e-5, rtol=2e-5)


@needs_kernel
def test_threads_give_identical_results(cpu_build):
    args = mixed_case(5, long=True)
    outs = [kernel(args, num_threads=n) for n in (1, 2, 3, 8)]
    for o in outs[1:]:
        np.testing.assert_array_equal(o, outs[0])


@needs_kernel
@pytest.mark.parametrize(
    "q_dtype,kv_dtype", [(jnp.bfloat16,) * 2, (jnp.float32, jnp.bfloat16), (jnp.bfloat16, jnp.float32)]
)
def test_bfloat16(cpu_build, q_dtype, kv_dtype):
    args = mixed_case(6, K=2, N=8, H=64, long=True)
    q = jnp.asarray(args[0], q_dtype)
    k, v = (jnp.asarray(x, kv_dtype) for x in args[1:3])
    got = cpu_attention.cpu_ragged_attention(q, k, v, *args[3:])
    assert got.dtype == q_dtype
    # The reference sees the same rounded inputs; the kernel adds at most one bf16 rounding of the output.
    tol = 2e-5 if q_dtype == jnp.float32 else 1e-2
    check(got, (*(np.asarray(x, np.float32) for x in (q, k, v)), *args[3:]), live_rows(args, lambda n: n >= 1),
          atol=tol)  # fmt: skip


@needs_kernel
@pytest.mark.parametrize("H,R,window,soft_cap", [(32, 4, None, None), (64, 4, 40, 5.0), (40, 2, None, None)])
@pytest.mark.parametrize("q_dtype", [jnp.float32, jnp.bfloat16])
def test_int8_pages(cpu_build, H, R, window, soft_cap, q_dtype):
    """Unused rows hold int8 garbage with NaN scales: dequantized they are NaN, so reading one fails."""
    rng = np.random.default_rng(H + R)
    args, scales, (k_deq, v_deq) = quantize_case(rng, mixed_case(H + R, K=2, N=2 * R, H=H, long=True))
    q = jnp.asarray(args[0], q_dtype)
    got = cpu_attention.cpu_ragged_attention(q, *args[1:], sliding_window=window, soft_cap=soft_cap, **scales)
    assert got.dtype == q_dtype
    tol = 2e-5 if q_dtype == jnp.float32 else 1e-2
    ref_args = (np.asarray(q, np.float32), k_deq, v_deq, *args[3:])
    check(got, ref_args, live_rows(args, lambda n: n >= 1), atol=tol, window=window, soft_cap=soft_cap)


@needs_kernel
def test_rejects_bad_rows():
    args = make_case(np.random.default_rng(0), [3], [5])
    with pytest.raises(ValueError, match="rows"):
        cpu_attention.cpu_ragged_attention(*args, rows="all")


# ---- inside the XLA ragged path --------------------------------------------------------------------------------


@needs_kernel
@pytest.mark.parametrize("decode_impl", ["ffi", "xla"])
@pytest.mark.parametrize("window,soft_cap", [(None, None), (6, 5.0)])
def test_ragged_with_ffi_prefill_matches_naive_and_the_xla_loops(decode_impl, window, soft_cap):
    args = mixed_case(9, long=True)
    kw = dict(sliding_window=window, soft_cap=soft_cap, slot_block=2, decode_kv_block=16, prefill_kv_block=32,
              q_block=8)  # fmt: skip
    run = lambda d, p: np.asarray(
        jax.jit(lambda *a: xla_ragged_paged_attention(*a, decode_impl=d, prefill_impl=p, **kw))(*args)
    )
    got, xla = run(decode_impl, "ffi"), run("xla", "xla")
    check(got, args, live_rows(args, lambda n: n >= 1), window=window, soft_cap=soft_cap)
    np.testing.assert_allclose(got, xla, atol=2e-5, rtol=2e-5)


def test_every_source_file_is_in_the_build_key(monkeypatch, tmp_path):
    """An edit to any file the library is built from (the header included) gives a new library and target name."""
    copies = []
    for f in library.SOURCES:
        (tmp_path / f.name).write_bytes(f.read_bytes())
        copies.append(tmp_path / f.name)
    assert {f.suffix for f in copies} == {".h", ".cc"} and len(copies) >= 4
    monkeypatch.setattr(library, "SOURCES", tuple(copies))
    key = lambda: (library.build_key.cache_clear(), library.build_key())[1]
    try:
        if key() is None:
            pytest.skip("no C++ compiler: there is no build key")
        seen = {key()[0]}
        for f in copies:
            f.write_bytes(f.read_bytes() + b"\n// edited\n")
            seen.add(key()[0])
        assert len(seen) == len(copies) + 1
    finally:
        library.build_key.cache_clear()


def test_every_source_file_is_packaged():
    """A non-editable install ships every file the library is built from (pyproject.toml's package-data)."""
    root = pathlib.Path(__file__).resolve().parents[2]
    package_data = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    packaged = {f for pattern in package_data["kernels_pallas"] for f in (root / "kernels_pallas").glob(pattern)}
    assert library.SOURCES and set(library.SOURCES) <= packaged
