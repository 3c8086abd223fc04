"""Decode `paged_attention` kernels (TPU and GPU variants, interpret mode) vs
the reference, plus the wrapper's validation.

The full product (page size x GQA ratio x head dim x dtype x options x
platform) is too slow to interpret on a small CPU, so CONFIGS samples it:
every (page size, GQA ratio) pair once, head dim and dtype alternating, and
the options spread over them. Inside one config every data scenario reuses
the compiled kernel (only runtime arrays change), which is where the edge
lengths, shuffled pages and NaN poisoning are covered.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas.paged_attention import paged_attention, reference_paged_attention
from tests.kernels.kv_cache_builder import (
    INT8_SHAPES,
    INTERPRET,
    PAGES_PER_SEQ,
    SHAPES,
    TOLERANCE,
    KernelConfig,
    check_against_reference,
    make_cache_and_queries,
)

_reference = jax.jit(reference_paged_attention, static_argnames=("sm_scale", "soft_cap", "sliding_window"))


# GPU tile of 16 tokens, small so that tests see several tiles; one config takes 64.
CONFIGS = [
    KernelConfig(**{"block_kv": 16, **shape, **({"block_kv": 64} if i == 2 else {})}) for i, shape in enumerate(SHAPES)
] + [KernelConfig(block_kv=16, **shape) for shape in INT8_SHAPES]


def _scenarios(page_size):
    """Batches of kv_lens with one compiled shape (B = 6)."""
    g, top = page_size, PAGES_PER_SEQ * page_size
    rng = np.random.default_rng(page_size)
    return {
        "edges": [0, 1, g - 1, g, g + 1, top],
        "random": list(rng.integers(0, top + 1, 6)),
        "all_empty": [0] * 6,
    }


def _run(config, platform, kv_lens, seed, interpret=None):
    rng = np.random.default_rng(seed)
    interpret = INTERPRET[platform] if interpret is None else interpret
    cache, q = make_cache_and_queries(config, kv_lens, len(kv_lens), rng)
    args = (q, cache.k_pages, cache.v_pages, cache.kv_lens, cache.page_indices)
    out = paged_attention(
        *args,
        **config.options,
        **cache.scales,
        interpret=interpret,
        platform=platform,
        block_kv=config.block_kv,
        num_splits=config.num_splits,
    )
    return out, _reference(*args, **config.options, **cache.scales)


@pytest.mark.parametrize("platform", ["tpu", "gpu"])
@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_kernel_matches_reference(config, platform):
    for seed, (name, kv_lens) in enumerate(_scenarios(config.page_size).items()):
        out, ref = _run(config, platform, kv_lens, seed)
        empty = np.asarray(kv_lens) == 0
        check_against_reference(out, ref, config, empty, f"scenario {name}, kv_lens {kv_lens}")


def test_generic_interpreter_runs_tpu_variant():
    # interpret=True (the generic interpreter) is the documented CPU mode.
    config = CONFIGS[1]
    kv_lens = _scenarios(config.page_size)["edges"]
    out, ref = _run(config, "tpu", kv_lens, seed=3, interpret=True)
    tol = TOLERANCE[config.dtype]
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), atol=tol, rtol=tol)


# ----------------------------------------------------------------------------
# Validation


def _args(B=2, N=4, H=16, K=2, P=6, G=8, pages_per_seq=3, dtype=jnp.float32):
    return dict(
        q=jnp.zeros((B, N, H), dtype),
        k_pages=jnp.zeros((K, P, G, H), dtype),
        v_pages=jnp.zeros((K, P, G, H), dtype),
        kv_lens=jnp.zeros((B,), jnp.int32),
        page_indices=jnp.zeros((B, pages_per_seq), jnp.int32),
    )


def _call(args, **kwargs):
    kwargs.setdefault("interpret", True)
    kwargs.setdefault("platform", "tpu")
    return paged_attention(**args, **kwargs)


def _with(**changes):
    args = _args()
    args.update(changes)
    return args


# int8 pages of _args() and scales of the right shape [K, P, G, 1], or of a wrong one.
_INT8 = dict(k_pages=jnp.zeros((2, 6, 8, 16), jnp.int8), v_pages=jnp.zeros((2, 6, 8, 16), jnp.int8))
_SCALES = dict(k_scales=jnp.ones((2, 6, 8, 1), jnp.float32), v_scales=jnp.ones((2, 6, 8, 1), jnp.float32))


@pytest.mark.parametrize(
    "args, kwargs, message",
    [
        (_with(q=jnp.zeros((2, 4), jnp.float32)), {}, r"q must be \[B, N, H\]"),
        (_with(k_pages=jnp.zeros((2, 6, 8), jnp.float32)), {}, "4-D"),
        (_with(v_pages=jnp.zeros((2, 6, 8, 32), jnp.float32)), {}, "v_pages shape"),
        (_with(q=jnp.zeros((2, 4, 16), jnp.bfloat16)), {}, "share one dtype"),
        (_with(q=jnp.zeros((2, 3, 16), jnp.float32)), {}, "multiple of kv heads"),
        (_with(q=jnp.zeros((2, 4, 32), jnp.float32)), {}, "head dim"),
        (_with(kv_lens=jnp.zeros((2,), jnp.float32)), {}, "kv_lens must be int32"),
        (_with(kv_lens=jnp.zeros((3,), jnp.int32)), {}, "kv_lens must have shape"),
        (_with(page_indices=jnp.zeros((3, 3), jnp.int32)), {}, r"page_indices must be \[B=2"),
        (_with(page_indices=jnp.zeros((2, 3), jnp.uint32)), {}, "page_indices must be int32"),
        (_args(), dict(sliding_window=0), "sliding_window"),
        (_args(), dict(soft_cap=-1.0), "soft_cap"),
        (_args(), dict(sm_scale=0.0), "sm_scale"),
        (_args(), dict(platform="npu"), "platform must be one of"),
        (_args(G=12), dict(platform="gpu"), "power-of-two page size"),
        (_args(H=24), dict(platform="gpu"), "power-of-two head dim"),
        (_args(), dict(platform="gpu", block_kv=8), "block_kv"),
        (_args(), dict(platform="gpu", num_splits=0), "num_splits"),
        (_args(), dict(platform="gpu", interpret=pltpu.InterpretParams()), "only applies to the TPU variant"),
        (_with(**_INT8), {}, "int8 pages need k_scales and v_scales"),
        (_args(), _SCALES, "only for int8 pages"),
        (_with(**_INT8), dict(k_scales=_SCALES["k_scales"]), "both or neither"),
        (_with(**_INT8), {**_SCALES, "v_scales": jnp.ones((2, 6, 8, 16), jnp.float32)}, r"v_scales must have shape"),
        (_with(**_INT8), {**_SCALES, "k_scales": jnp.ones((2, 6, 8, 1), jnp.bfloat16)}, "k_scales must be float32"),
        (_with(k_pages=_INT8["k_pages"]), _SCALES, "only for int8 pages"),
    ],
    ids=lambda x: x if isinstance(x, str) else None,
)
def test_validation_errors(args, kwargs, message):
    with pytest.raises(ValueError, match=message):
        _call(args, **kwargs)


def test_cpu_interpret_defaults_to_tpu_variant():
    if jax.default_backend() != "cpu":
        pytest.skip("only meaningful where the default backend is CPU")
    jaxpr = jax.make_jaxpr(lambda *a: paged_attention(*a, interpret=True))(*_args().values())
    assert "paged_attention_tpu" in str(jaxpr)
    assert "paged_attention_gpu" not in str(jaxpr)


def test_cpu_without_interpret_is_refused():
    if jax.default_backend() != "cpu":
        pytest.skip("only meaningful where the default backend is CPU")
    with pytest.raises(ValueError, match="do not run compiled on CPU"):
        paged_attention(**_args())
