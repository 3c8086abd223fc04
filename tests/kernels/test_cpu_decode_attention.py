"""The C++ FFI decode attention for CPU (kernels_pallas/cpu/attention.py) against the naive float64 attention,
alone and inside the XLA ragged path (decode_impl="ffi"), NaN-poisoned pages and garbage page tables included.
The tests taking `cpu_build` run against the default build and the portable one, without AVX-512 (conftest.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.cpu import attention as cpu_attention
from kernels_pallas.cpu import library
from kernels_pallas.xla_attention import resolve_decode_impl, resolve_prefill_impl, xla_ragged_paged_attention
from tests.kernels.test_xla_attention import CASES, make_case
from tests.kernels.test_xla_attention import naive as naive_all

needs_kernel = pytest.mark.skipif(
    not cpu_attention.available(), reason=f"FFI kernel unavailable: {cpu_attention.unavailable_reason()}"
)


def test_kernel_builds_where_a_compiler_exists():
    """The other tests skip without a C++ compiler; with one, a failed build is a failure, not a skip."""
    if not library.compiler_found():
        pytest.skip("no C++ compiler: the engine uses the XLA decode path (tested in test_xla_attention.py)")
    assert cpu_attention.available(), cpu_attention.unavailable_reason()


GARBAGE = np.array([-1, -(2**31), 2**31 - 1, 10**6], np.int32)


def naive(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, live=None, **kw):
    """The float64 reference of test_xla_attention, over the sequences in `live` only (default: all): it has no
    answer for a query with an empty context, which the kernel must turn into zeros."""
    if live is None:
        return naive_all(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **kw)
    out = np.zeros(q.shape)
    for i in live:
        a, b = cu_q_lens[i], cu_q_lens[i + 1]
        one = naive_all(
            q[a:b],
            k_pages,
            v_pages,
            kv_lens[i : i + 1],
            page_indices[i : i + 1],
            np.array([0, b - a]),
            np.array([1]),
            **kw,
        )
        out[a:b] = one
    return out


def poison_page_table(rng, args, G):
    """Page-table entries past each sequence's used pages become garbage (negative, huge): never dereferenced."""
    page_indices, kv_lens = args[4].copy(), args[3]
    for i, L in enumerate(kv_lens):
        used = -(-int(L) // G)
        page_indices[i, used:] = rng.choice(GARBAGE, page_indices.shape[1] - used)
    return (*args[:4], page_indices, *args[5:])


def decode_rows(args):
    """Rows owned by live sequences with q_len 1."""
    cu, num_seqs = args[5], int(args[6][0])
    return [int(cu[i]) for i in range(num_seqs) if cu[i + 1] - cu[i] == 1]


def check_kernel(args, *, window=None, soft_cap=None, atol=2e-5, **kw):
    got = np.asarray(
        jax.jit(lambda *a: cpu_attention.cpu_decode_attention(*a, sliding_window=window, soft_cap=soft_cap, **kw))(
            *args
        )
    )
    want = naive(*args, window=window, soft_cap=soft_cap)
    assert np.all(np.isfinite(got)), "NaN from an unused page reached the output"
    rows = decode_rows(args)
    np.testing.assert_allclose(got[rows], want[rows], atol=atol, rtol=atol)
    others = np.setdiff1d(np.arange(got.shape[0]), rows)
    assert np.all(got[others] == 0), "rows that are not decode rows must be zero"
    return got


# Context lengths: 1, either side of and exactly at page boundaries, and a long one.
def decode_lens(G):
    return [1, G - 1, G, G + 1, 2 * G, 3 * G - 1, 5 * G + 3]


def decode_case(seed, *, K=2, N=8, H=64, G=16):
    """A decode-only batch over decode_lens(G), page-table tails poisoned."""
    rng = np.random.default_rng(seed)
    lens = decode_lens(G)
    return poison_page_table(rng, make_case(rng, [1] * len(lens), lens, K=K, N=N, H=H, G=G), G)


@needs_kernel
@pytest.mark.parametrize("R", [1, 2, 4, 8])
@pytest.mark.parametrize("H", [32, 64, 128])
def test_decode_matches_naive_gqa_and_head_dims(cpu_build, R, H):
    args = decode_case(R * 1000 + H, K=2, N=2 * R, H=H, G=16)
    check_kernel(args)


@needs_kernel
@pytest.mark.parametrize("G", [8, 16, 32])
@pytest.mark.parametrize("window,soft_cap", [(None, None), (1, None), (6, None), (21, None), (None, 5.0), (9, 3.0)])
def test_decode_page_sizes_window_soft_cap(cpu_build, G, window, soft_cap):
    args = decode_case(G, G=G)
    check_kernel(args, window=window, soft_cap=soft_cap)


@needs_kernel
@pytest.mark.parametrize("G,window,soft_cap", [(8, 6, None), (16, 21, 3.0), (32, None, 5.0)])
def test_decode_shared_transpose_scores_window_soft_cap(cpu_build, G, window, soft_cap):
    """H 32 with R 4 (llama-tiny) scores through partial transposes of K shared by the heads, not per-head trees:
    partial 16-row blocks from windows, page ends and page sizes other than 16."""
    args = decode_case(G + 1, K=2, N=8, H=32, G=G)
    check_kernel(args, window=window, soft_cap=soft_cap)


@needs_kernel
@pytest.mark.parametrize("H", [16, 40, 256])
def test_other_head_dims(cpu_build, H):
    """256: the widest compiled-in head dim; 40: the generic (runtime H, not a multiple of 16) path."""
    args = decode_case(H, K=1, N=3, H=H, G=8)
    check_kernel(args)


@needs_kernel
def test_sm_scale(cpu_build):
    rng = np.random.default_rng(7)
    args = make_case(rng, [1, 1], [9, 30], H=32)
    got = np.asarray(cpu_attention.cpu_decode_attention(*args, sm_scale=0.5))
    q = args[0] * (0.5 * np.sqrt(32))  # naive scales by H ** -0.5
    want = naive(q, *args[1:])
    rows = decode_rows(args)
    np.testing.assert_allclose(got[rows], want[rows], atol=2e-5, rtol=2e-5)


@needs_kernel
def test_empty_slots_prefill_rows_padding_and_sequences_past_num_seqs(cpu_build):
    rng = np.random.default_rng(11)
    # A decode, an empty slot, a prefill, a decode with an empty context (zeros, not NaN), a decode.
    args = poison_page_table(rng, make_case(rng, [1, 0, 5, 1, 1], [17, 0, 5, 0, 33], G=8), 8)
    q, k, v, kv, pt, cu, num_seqs = args
    got = np.asarray(cpu_attention.cpu_decode_attention(*args))
    assert np.all(np.isfinite(got))
    want = naive(q, k, v, kv, pt, cu, num_seqs, live=[0, 4])
    rows = [int(cu[0]), int(cu[4])]
    np.testing.assert_allclose(got[rows], want[rows], atol=2e-5, rtol=2e-5)
    others = np.setdiff1d(np.arange(got.shape[0]), rows)
    assert np.all(got[others] == 0), "prefill rows, padding and the empty-context decode must be zero"
    # Sequences >= num_seqs are ignored even when their cu_q_lens make them look like decodes.
    got4 = np.asarray(cpu_attention.cpu_decode_attention(q, k, v, kv, pt, cu, np.array([4], np.int32)))
    assert np.all(got4[cu[4] :] == 0)
    np.testing.assert_array_equal(got4[: cu[4]], got[: cu[4]])


@needs_kernel
def test_threads_give_identical_results(cpu_build):
    """Each (sequence, kv head) is computed by one thread in a fixed order: the thread count changes nothing."""
    rng = np.random.default_rng(5)
    lens = list(rng.integers(1, 200, 40))
    args = make_case(rng, [1] * len(lens), lens, K=2, N=8, H=64, G=16)
    outs = [np.asarray(cpu_attention.cpu_decode_attention(*args, num_threads=n)) for n in (1, 2, 3, 8)]
    for o in outs[1:]:
        np.testing.assert_array_equal(o, outs[0])


@needs_kernel
@pytest.mark.parametrize("H", [32, 64, 40])
def test_bfloat16(cpu_build, H):
    args = decode_case(H, H=H)
    bf = [jnp.asarray(x, jnp.bfloat16) for x in args[:3]]
    got = cpu_attention.cpu_decode_attention(*bf, *args[3:])
    assert got.dtype == jnp.bfloat16
    got = np.asarray(got, np.float32)
    assert np.all(np.isfinite(got))
    # The reference sees the same bf16-rounded inputs; the kernel adds one rounding of the output.
    want = naive(*(np.asarray(x, np.float32) for x in bf), *args[3:])
    rows = decode_rows(args)
    np.testing.assert_allclose(got[rows], want[rows], atol=1e-2, rtol=1e-2)


@needs_kernel
@pytest.mark.parametrize("q_dtype,kv_dtype", [(jnp.float32, jnp.bfloat16), (jnp.bfloat16, jnp.float32)])
def test_query_and_cache_dtypes_may_differ(cpu_build, q_dtype, kv_dtype):
    """A float32 model with a bfloat16 KV cache (and the reverse): output in q's dtype, math in f32."""
    args = decode_case(7)
    q = jnp.asarray(args[0], q_dtype)
    k, v = (jnp.asarray(x, kv_dtype) for x in args[1:3])
    got = cpu_attention.cpu_decode_attention(q, k, v, *args[3:])
    assert got.dtype == q_dtype
    want = naive(*(np.asarray(x, np.float32) for x in (q, k, v)), *args[3:])
    rows = decode_rows(args)
    tol = 2e-5 if q_dtype == jnp.float32 else 1e-2  # only the output's rounding to bf16 adds error
    np.testing.assert_allclose(np.asarray(got, np.float32)[rows], want[rows], atol=tol, rtol=tol)


@needs_kernel
def test_rejects_bad_inputs():
    rng = np.random.default_rng(0)
    q, k, v, *meta = make_case(rng, [1], [5])
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        cpu_attention.cpu_decode_attention(q, jnp.asarray(k, jnp.bfloat16), v, *meta)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        cpu_attention.cpu_decode_attention(jnp.asarray(q, jnp.float16), k, v, *meta)
    with pytest.raises(ValueError, match="multiple"):
        cpu_attention.cpu_decode_attention(q[:, :3], k, v, *meta)


# ---- inside the XLA ragged path: the FFI decode rows combined with the XLA prefill rows ---------------------
# (the FFI prefill rows: test_cpu_prefill_attention.py)


@needs_kernel
@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("window,soft_cap", [(None, None), (6, None), (None, 5.0)])
def test_ragged_with_ffi_decode_matches_naive_and_xla_decode(name, window, soft_cap):
    rng = np.random.default_rng(sorted(CASES).index(name))  # str hashes change per process
    q_lens, kv_lens = CASES[name]
    args = make_case(rng, q_lens, kv_lens)
    kw = dict(
        sliding_window=window, soft_cap=soft_cap, slot_block=2, decode_kv_block=16, prefill_kv_block=32, q_block=8
    )
    run = lambda impl: np.asarray(
        jax.jit(lambda *a: xla_ragged_paged_attention(*a, decode_impl=impl, prefill_impl="xla", **kw))(*args)
    )
    got, xla = run("ffi"), run("xla")
    want = naive(*args, window=window, soft_cap=soft_cap)
    assert np.all(np.isfinite(got)), "NaN from an unused page reached the output"
    T_live = int(args[5][int(args[6][0])])
    np.testing.assert_allclose(got[:T_live], want[:T_live], atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(got, xla, atol=2e-5, rtol=2e-5)
    assert np.all(got[T_live:] == 0), "padding rows must be zero"


@needs_kernel
def test_ragged_bfloat16_ffi_close_to_xla():
    rng = np.random.default_rng(3)
    args = make_case(rng, [1, 1, 9, 1], [20, 3, 9, 70])
    q, k, v = (jnp.asarray(np.nan_to_num(x), jnp.bfloat16) for x in args[:3])
    ffi = xla_ragged_paged_attention(q, k, v, *args[3:], decode_impl="ffi", prefill_impl="xla")
    xla = xla_ragged_paged_attention(q, k, v, *args[3:], decode_impl="xla", prefill_impl="xla")
    assert ffi.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(ffi, np.float32), np.asarray(xla, np.float32), atol=2e-2, rtol=2e-2)


# ---- choosing the implementation, and falling back when the kernel cannot be built ---------------------------


@pytest.mark.parametrize(
    "resolve,env_var,name",
    [
        (resolve_decode_impl, "CBJAX_DECODE_ATTENTION", "decode_impl"),
        (resolve_prefill_impl, "CBJAX_PREFILL_ATTENTION", "prefill_impl"),
    ],
)
def test_resolve_impl(monkeypatch, resolve, env_var, name):
    monkeypatch.delenv(env_var, raising=False)
    assert resolve("xla") == "xla"
    assert resolve("auto") == ("ffi" if cpu_attention.available() else "xla")
    monkeypatch.setenv(env_var, "xla")
    assert resolve("auto") == "xla"
    assert resolve("ffi") == "xla"  # the environment wins
    monkeypatch.setenv(env_var, "bogus")
    with pytest.raises(ValueError, match=name):
        resolve("auto")


def test_build_failure_falls_back_to_xla(monkeypatch, tmp_path):
    """No working compiler: available() is False with a reason, "auto" takes the XLA path, results unchanged."""
    monkeypatch.delenv("CBJAX_DECODE_ATTENTION", raising=False)
    monkeypatch.delenv("CBJAX_PREFILL_ATTENTION", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CXX", "false")  # a "compiler" that always fails
    with library.fresh_state():  # forgets the library registered here; it comes back after the block
        assert not cpu_attention.available()
        assert "failed" in cpu_attention.unavailable_reason()
        assert resolve_decode_impl("auto") == resolve_prefill_impl("auto") == "xla"
        with pytest.raises(RuntimeError, match="unavailable"):
            resolve_decode_impl("ffi")
        with pytest.raises(RuntimeError, match="unavailable"):
            resolve_prefill_impl("ffi")
        args = make_case(np.random.default_rng(0), [1, 4], [9, 4])
        got = np.asarray(xla_ragged_paged_attention(*args))
        np.testing.assert_allclose(got[:5], naive(*args)[:5], atol=2e-5, rtol=2e-5)
        monkeypatch.setenv("CXX", "surely-no-such-compiler")
        with library.fresh_state():
            assert not cpu_attention.available()
            assert "no C++ compiler" in cpu_attention.unavailable_reason()


# ---- bf16 dot products (AVX512-BF16) over bf16 pages -------------------------------------------------------------


def _decode(args, **kw):
    return np.asarray(jax.jit(lambda *a: cpu_attention.cpu_decode_attention(*a, **kw))(*args), np.float32)


def _bf16_dots_built() -> bool:
    return bool(library.features() and library.features()["avx512bf16"])


@needs_kernel
@pytest.mark.parametrize("q_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("H,R,window,soft_cap", [(64, 4, None, None), (32, 8, 37, None), (128, 2, None, 30.0)])
def test_bf16_dots_match_naive_on_rounded_queries(cpu_build, q_dtype, H, R, window, soft_cap):
    """bf16_dots over bf16 pages: the reference sees q rounded to bf16 (as the kernel does); the softmax weights'
    rounding to bf16 adds ~2^-9 relative. NaN fills every slot past each context and odd page tails pair with a
    zero row, so an output stays finite only if no NaN row is multiplied in. A build without AVX512-BF16 (the
    portable one) runs the float32-math kernel: bit for bit what it gives without the flag."""
    args = decode_case(R * 100 + H, N=2 * R, H=H, G=16)
    q = jnp.asarray(args[0], q_dtype)
    k, v = (jnp.asarray(x, jnp.bfloat16) for x in args[1:3])
    inputs = (q, k, v, *args[3:])
    got = _decode(inputs, bf16_dots=True, sliding_window=window, soft_cap=soft_cap)
    plain = _decode(inputs, bf16_dots=False, sliding_window=window, soft_cap=soft_cap)
    rows = decode_rows(args)
    assert np.all(np.isfinite(got[rows]))
    q_rounded = np.asarray(jnp.asarray(q, jnp.bfloat16), np.float32)
    want = naive(q_rounded, *(np.asarray(x, np.float32) for x in (k, v)), *args[3:], window=window, soft_cap=soft_cap)
    np.testing.assert_allclose(got[rows], want[rows], atol=1e-2, rtol=1e-2)
    others = np.setdiff1d(np.arange(got.shape[0]), rows)
    assert np.all(got[others] == 0)
    if cpu_build == "native" and _bf16_dots_built():
        assert not np.array_equal(got, plain), "bf16_dots did not reach the vdpbf16ps kernel"
    else:
        np.testing.assert_array_equal(got, plain)


@needs_kernel
@pytest.mark.parametrize("pages,H", [(jnp.float32, 64), (jnp.int8, 64), (jnp.bfloat16, 40)])
def test_bf16_dots_leave_other_pages_and_head_dims_bit_identical(pages, H):
    """Where the bf16 dot kernel does not apply (float32 or int8 pages, a head dim not a multiple of 32) the flag
    changes nothing, bit for bit."""
    args = decode_case(H, H=H)
    if pages == jnp.int8:
        k, v = (jnp.asarray(np.clip(np.nan_to_num(x) * 30, -127, 127), jnp.int8) for x in args[1:3])
        scales = jnp.full((*k.shape[:3], 1), 1 / 30, jnp.float32)
        kw = dict(k_scales=scales, v_scales=scales)
    else:
        k, v = (jnp.asarray(x, pages) for x in args[1:3])
        kw = {}
    inputs = (args[0], k, v, *args[3:])
    np.testing.assert_array_equal(_decode(inputs, bf16_dots=True, **kw), _decode(inputs, bf16_dots=False, **kw))


@needs_kernel
def test_bf16_dots_do_not_depend_on_the_thread_count():
    rng = np.random.default_rng(11)
    lens = list(rng.integers(1, 200, 40))
    args = make_case(rng, [1] * len(lens), lens, K=2, N=8, H=64, G=16)
    inputs = (args[0], *(jnp.asarray(x, jnp.bfloat16) for x in args[1:3]), *args[3:])
    outs = [_decode(inputs, bf16_dots=True, num_threads=n) for n in (1, 2, 8)]
    for o in outs[1:]:
        np.testing.assert_array_equal(o, outs[0])


def test_bf16_dots_come_from_the_environment(monkeypatch):
    monkeypatch.delenv(cpu_attention.BF16_DOTS_ENV_VAR, raising=False)
    assert cpu_attention.resolve_bf16_dots() is False
    monkeypatch.setenv(cpu_attention.BF16_DOTS_ENV_VAR, "on")
    assert cpu_attention.resolve_bf16_dots() is True
    monkeypatch.setenv(cpu_attention.BF16_DOTS_ENV_VAR, "yes")
    with pytest.raises(ValueError, match="CBJAX_ATTENTION_BF16_DOTS"):
        cpu_attention.resolve_bf16_dots()


# ---- the engine on the FFI path -----------------------------------------------------------------------------


@needs_kernel
def test_engine_greedy_tokens_equal_full_forward_with_ffi_decode(monkeypatch):
    from cbjax import LLM, LLMEngine
    from cbjax.model import get_model_config, init_model
    from tests.helpers import greedy_reference, random_workload

    monkeypatch.setenv("CBJAX_DECODE_ATTENTION", "ffi")
    model = init_model(get_model_config("test-tiny"), seed=0)
    prompts, params = random_workload(16, seed=4, vocab=model.cfg.vocab_size, prompt_range=(1, 120))
    width = 200
    ref = greedy_reference(model, prompts, [p.max_tokens for p in params], width=width)
    # No program cache: a program saved with the other decode path must not stand in for this one.
    engine = LLMEngine(
        model,
        num_pages=128,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        page_size=16,
        max_model_len=width,
        compilation_cache="off",
    )
    got = [o.outputs[0].token_ids for o in LLM.from_engine(engine).generate(prompts, params)]
    assert got == ref
    assert any(s["num_scheduled_seqs"] > 1 for s in engine.step_records)
