"""bfloat16 KV pages on CPU: the new rows are written in place by the C++ handler (kernels_pallas/kv_write.py; XLA:CPU
has no bf16 scatter and rewrote one into two passes over the whole cache), the attention over them runs on the
C++ kernel rather than the XLA loop, and the engine's greedy tokens equal the full forward whose K and V are
rounded to bf16 (the only change a bf16 cache makes to a float32 model)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cbjax import LLMEngine
from cbjax.model import get_model_config, init_model
from kernels_pallas import kv_write
from kernels_pallas.cpu import library
from kernels_pallas.dispatch import ragged_attention
from kernels_pallas.xla_attention import resolve_cpu_impls
from tests.helpers import random_workload
from tests.test_engine_exact import MAX_MODEL_LEN, OPTS, run_and_check

needs_library = pytest.mark.skipif(
    library.kv_write_target() is None, reason=f"CPU kernels unavailable: {library.unavailable_reason()}"
)
K, P, G = 2, 9, 16  # 8 live pages and the spare one


def _write(impl, pages, rows, slots):
    f = jax.jit(functools.partial(kv_write.write_rows, impl=impl), donate_argnums=0)
    return np.asarray(f(jnp.array(pages, copy=True), jnp.asarray(rows), jnp.asarray(slots, jnp.int32)))  # donated


@needs_library
@pytest.mark.parametrize(
    "pages_dtype,rows_dtype,X",
    [
        (jnp.bfloat16, jnp.float32, 32),  # a float32 model over a bf16 cache
        (jnp.bfloat16, jnp.bfloat16, 32),
        (jnp.float32, jnp.float32, 32),
        (jnp.int8, jnp.int8, 32),  # int8 pages
        (jnp.float32, jnp.float32, 1),  # their scales
    ],
)
def test_kernel_writes_the_rows_xla_scatters(pages_dtype, rows_dtype, X):
    rng = np.random.default_rng(0)
    pages = np.asarray(jnp.asarray(rng.standard_normal((K, P, G, X)) * 20).astype(pages_dtype))  # kept if unwritten
    T = 24
    rows = rng.standard_normal((T, K, X)).astype(np.float32) * 3
    rows[5, 1, 0] = np.nan  # converted as XLA does: still NaN
    rows[6, 0, -1] = 1 + 2**-8  # a bf16 rounding tie: to even
    rows = jnp.asarray(rows).astype(rows_dtype)
    slots = rng.permutation((P - 1) * G)[:T]
    slots[-4:] = (P - 1) * G + np.arange(4)  # padding tokens: the spare page
    got, want = _write("ffi", pages, rows, slots), _write("xla", pages, rows, slots)
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))  # bit for bit, NaN included
    assert not np.array_equal(got.view(np.uint8), np.asarray(pages).view(np.uint8))


@needs_library
def test_a_bf16_write_touches_the_rows_not_the_whole_cache():
    """The compiled write of bf16 pages holds no float32 array of the cache's size; XLA's scatter does (it is why
    the handler exists: if XLA learns bf16 scatter, the second assertion says so)."""
    pages = jax.ShapeDtypeStruct((K, P, G, 64), jnp.bfloat16)
    rows, slots = jax.ShapeDtypeStruct((8, K, 64), jnp.float32), jax.ShapeDtypeStruct((8,), jnp.int32)
    f32_cache = f"f32[{K},{P * G},64]"

    def hlo(impl):
        f = jax.jit(functools.partial(kv_write.write_rows, impl=impl), donate_argnums=0)
        return f.lower(pages, rows, slots).compile().as_text()

    assert library.kv_write_target() in hlo("auto") and f32_cache not in hlo("auto")
    assert f32_cache in hlo("xla")


@needs_library
def test_auto_takes_the_kernel_for_bf16_pages_only(monkeypatch):
    monkeypatch.delenv(kv_write.ENV_VAR, raising=False)
    assert kv_write.resolve_kv_write(jnp.bfloat16) == "ffi"
    for dtype in (jnp.float32, jnp.int8):  # their scatter costs the rows written: float32 runs stay as they were
        assert kv_write.resolve_kv_write(dtype) == "xla"
    assert kv_write.resolve_kv_write(jnp.bfloat16, sharded=True) == "xla"
    monkeypatch.setenv(kv_write.ENV_VAR, "xla")
    assert kv_write.resolve_kv_write(jnp.bfloat16) == "xla"
    monkeypatch.setenv(kv_write.ENV_VAR, "fast")
    with pytest.raises(ValueError, match="CBJAX_KV_WRITE"):
        kv_write.resolve_kv_write(jnp.bfloat16)


def test_bad_rows_are_refused():
    with pytest.raises(ValueError, match="rows"):
        kv_write.write_rows(jnp.zeros((K, P, G, 8)), jnp.zeros((3, K + 1, 8)), jnp.zeros((3,), jnp.int32))


@needs_library
def test_attention_over_bf16_pages_runs_the_cpu_kernel_not_the_xla_loop(monkeypatch):
    """A float32 model's queries over bf16 pages: with the default choices both halves go to the C++ kernel (one
    call, no XLA while loop in the program)."""
    for var in ("CBJAX_DECODE_ATTENTION", "CBJAX_PREFILL_ATTENTION"):
        monkeypatch.delenv(var, raising=False)
    if resolve_cpu_impls()[:2] != ("ffi", "ffi"):
        pytest.skip(f"this build's auto choices are {resolve_cpu_impls()}")
    H = 32
    args = (
        jax.ShapeDtypeStruct((8, 2 * K, H), jnp.float32),
        jax.ShapeDtypeStruct((K, P, G, H), jnp.bfloat16),
        jax.ShapeDtypeStruct((K, P, G, H), jnp.bfloat16),
        jax.ShapeDtypeStruct((2,), jnp.int32),
        jax.ShapeDtypeStruct((2, 4), jnp.int32),
        jax.ShapeDtypeStruct((3,), jnp.int32),
        jax.ShapeDtypeStruct((1,), jnp.int32),
    )
    text = jax.jit(functools.partial(ragged_attention, backend="xla")).lower(*args).compile().as_text()
    assert library.attention_target() in text
    assert " while(" not in text


def _bf16_round_trip(x):
    return x.astype(jnp.bfloat16).astype(x.dtype)


def _greedy_bf16_kv_reference(model, prompts, max_tokens):
    """Greedy decoding with the full forward, K and V rounded to bf16 as the cache stores them."""
    fwd = jax.jit(lambda tokens: model.forward_full(tokens, kv_round_trip=_bf16_round_trip))
    toks = np.zeros((len(prompts), MAX_MODEL_LEN), np.int32)
    lens = np.array([len(p) for p in prompts])
    for i, p in enumerate(prompts):
        toks[i, : len(p)] = p
    outs = [[] for _ in prompts]
    for _ in range(max(max_tokens)):
        logits = fwd(jnp.asarray(toks))
        nxt = np.asarray(jnp.argmax(logits[np.arange(len(prompts)), lens - 1], axis=-1))
        for i, n in enumerate(nxt):
            if len(outs[i]) < max_tokens[i]:
                outs[i].append(int(n))
                toks[i, lens[i]] = n
                lens[i] += 1
    return outs


def test_engine_greedy_tokens_over_bf16_pages_equal_the_bf16_rounded_full_forward():
    model = init_model(get_model_config("test-tiny"), seed=0)
    prompts, params = random_workload(16, seed=7, vocab=model.cfg.vocab_size)
    ref = _greedy_bf16_kv_reference(model, prompts, [p.max_tokens for p in params])
    engine = LLMEngine(model, kv_cache_dtype="bfloat16", num_pages=256, **OPTS)
    assert engine.runner.kv_caches[0][0].dtype == jnp.bfloat16
    run_and_check(engine, prompts, params, ref)


@needs_library
def test_page_copies_and_swap_ins_write_bf16_pages_in_place():
    """Copy-on-write (runner/page_copy.py) and swap-ins (runner/kv_swap.py) write whole bf16 pages through the
    handler too (kv_write.write_pages): the same pages as a plain copy, and no float32 array of the cache's size."""
    from cbjax.runner import kv_swap, page_copy

    rng = np.random.default_rng(1)
    X = 64
    arrays = [np.asarray(jnp.asarray(rng.standard_normal((K, P, G, X))).astype(jnp.bfloat16)) for _ in range(4)]
    caches = lambda: [
        (jnp.asarray(arrays[0]), jnp.asarray(arrays[1])),
        (jnp.asarray(arrays[2]), jnp.asarray(arrays[3])),
    ]
    src, dst = np.array([1, 4, 8], np.int32), np.array([2, 5, 8], np.int32)  # the last: the spare page onto itself
    got = page_copy.copy_pages(caches(), jnp.asarray(src), jnp.asarray(dst))
    for a, g in zip(arrays, [x for c in got for x in c]):
        want = a.copy()
        want[:, dst] = a[:, src]
        np.testing.assert_array_equal(np.asarray(g).view(np.uint16), want.view(np.uint16))
    blocks = kv_swap.gather_pages(caches(), jnp.asarray([3, 6], jnp.int32))
    moved = kv_swap.scatter_pages(caches(), jnp.asarray([0, 7], jnp.int32), blocks)
    for a, g in zip(arrays, [x for c in moved for x in c]):
        want = a.copy()
        want[:, [0, 7]] = a[:, [3, 6]]
        np.testing.assert_array_equal(np.asarray(g).view(np.uint16), want.view(np.uint16))
    shapes = [tuple(jax.ShapeDtypeStruct((K, P, G, X), jnp.bfloat16) for _ in range(2))]
    idx = jax.ShapeDtypeStruct((3,), jnp.int32)
    copy = jax.jit(functools.partial(page_copy.copy_pages, sharded=False)).lower(shapes, idx, idx).compile().as_text()
    swap_out = jax.jit(kv_swap.gather_pages).lower(shapes, idx).compile().as_text()
    assert library.kv_write_target() in copy
    for text in (copy, swap_out):
        assert f"f32[{K},{P},{G},{X}]" not in text and f"f32[{K},{P * G},{X}]" not in text
