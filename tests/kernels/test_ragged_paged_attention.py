"""`ragged_paged_attention` kernels (TPU and GPU variants, interpret mode) vs
the reference, plus the wrapper's validation.

As in test_paged_attention.py, CONFIGS samples the product (every (page size,
GQA ratio) pair once) and each config replays several batches through one
compiled kernel: mixed, decode-only, prefill-only, one long prefill, and no
sequences at all, all over NaN-poisoned, shuffled pages.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas.ragged_paged_attention import ragged_paged_attention, reference_ragged_paged_attention
from tests.kernels.kv_cache_builder import (
    INT8_SHAPES,
    INTERPRET,
    PAGES_PER_SEQ,
    SHAPES,
    KernelConfig,
    check_against_reference,
    make_cache_and_queries,
    ragged_metadata,
)

MAX_SEQS = 6

_reference = jax.jit(reference_ragged_paged_attention, static_argnames=("sm_scale", "soft_cap", "sliding_window"))


# Per config, block options that differ from the wrapper's defaults, so the tiling paths get exercised.
_BLOCKS = {3: dict(block_q=16), 4: dict(num_splits=1), 6: dict(block_kv="default"), 7: dict(block_q=4)}
CONFIGS = [KernelConfig(**{**shape, **_BLOCKS.get(i, {})}) for i, shape in enumerate(SHAPES)] + [
    KernelConfig(**shape) for shape in INT8_SHAPES
]


def _kv_block(config):
    """Tokens per kv step: 2 pages unless set (TPU: two DMAs per chunk, so the double buffer sees several chunks);
    "default" leaves it to the wrapper."""
    if config.block_kv == "default":
        return None
    return config.block_kv or max(16, 2 * config.page_size)


def _num_tokens(page_size):
    # Room for the longest scenario, and deliberately not a multiple of any
    # block_q so that the wrapper's token padding is exercised.
    return 5 * page_size + 3


def _scenarios(page_size):
    """(kv_lens, q_lens, num_seqs) batches, all with MAX_SEQS slots."""
    g, top = page_size, PAGES_PER_SEQ * page_size
    return {
        # Empty slot, decode, full prefill, decode at a page edge, chunked
        # prefill crossing a page edge, chunked prefill of a full context.
        "mixed": ([0, 1, g - 1, g, g + 1, top], [0, 1, g - 1, 1, 3, 2 * g], 6),
        # The sixth slot is dead: its metadata is garbage and must be ignored.
        "decode_only": ([1, g - 1, g, g + 1, top, 9], [1, 1, 1, 1, 1, 1], 5),
        "prefill_only": ([g + 1, g, g - 1, 1, 0, 2], [g + 1, g, g - 1, 1, 0, 2], 6),
        "long_prefill": ([top, top, 0, 0, 0, 0], [top, g, 0, 0, 0, 0], 2),
        "no_sequences": ([5, 5, 5, 5, 5, 5], [1, 1, 1, 1, 1, 1], 0),
    }


def _run(config, platform, kv_lens, q_lens, num_seqs, seed, interpret=None):
    rng = np.random.default_rng(seed)
    interpret = INTERPRET[platform] if interpret is None else interpret
    cache, q = make_cache_and_queries(config, kv_lens, _num_tokens(config.page_size), rng)
    kv = np.asarray(cache.kv_lens).copy()
    kv[num_seqs:] = rng.integers(-5, 10_000, MAX_SEQS - num_seqs)
    cu_q_lens, num = ragged_metadata(q_lens, num_seqs, MAX_SEQS, rng)
    args = (q, cache.k_pages, cache.v_pages, jnp.asarray(kv, jnp.int32), cache.page_indices, cu_q_lens, num)
    out = ragged_paged_attention(
        *args,
        **config.options,
        **cache.scales,
        interpret=interpret,
        platform=platform,
        block_q=config.block_q,
        block_kv=_kv_block(config),
        num_splits=config.num_splits if platform == "gpu" else None,
    )
    return out, _reference(*args, **config.options, **cache.scales), int(np.sum(q_lens[:num_seqs]))


@pytest.mark.parametrize("platform", ["tpu", "gpu"])
@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_kernel_matches_reference(config, platform):
    scenarios = _scenarios(config.page_size)
    for seed, (name, (kv_lens, q_lens, num_seqs)) in enumerate(scenarios.items()):
        out, ref, live_rows = _run(config, platform, kv_lens, q_lens, num_seqs, seed)
        padding = np.arange(out.shape[0]) >= live_rows
        check_against_reference(out, ref, config, padding, f"scenario {name}: kv_lens {kv_lens}, q_lens {q_lens}")


def test_generic_interpreter_runs_tpu_variant():
    # interpret=True (the generic interpreter) is the documented CPU mode.
    config = CONFIGS[0]
    kv_lens, q_lens, num_seqs = _scenarios(config.page_size)["mixed"]
    out, ref, _ = _run(config, "tpu", kv_lens, q_lens, num_seqs, seed=3, interpret=True)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-5, rtol=2e-5)


# ----------------------------------------------------------------------------
# Validation


def _args(T=8, N=4, H=16, K=2, P=6, G=8, S=3, pages_per_seq=2, dtype=jnp.float32):
    return dict(
        q=jnp.zeros((T, N, H), dtype),
        k_pages=jnp.zeros((K, P, G, H), dtype),
        v_pages=jnp.zeros((K, P, G, H), dtype),
        kv_lens=jnp.zeros((S,), jnp.int32),
        page_indices=jnp.zeros((S, pages_per_seq), jnp.int32),
        cu_q_lens=jnp.zeros((S + 1,), jnp.int32),
        num_seqs=jnp.zeros((1,), jnp.int32),
    )


def _with(**changes):
    args = _args()
    args.update(changes)
    return args


# int8 pages of _args() and scales of the right shape [K, P, G, 1].
_INT8 = dict(k_pages=jnp.zeros((2, 6, 8, 16), jnp.int8), v_pages=jnp.zeros((2, 6, 8, 16), jnp.int8))
_SCALES = dict(k_scales=jnp.ones((2, 6, 8, 1), jnp.float32), v_scales=jnp.ones((2, 6, 8, 1), jnp.float32))


@pytest.mark.parametrize(
    "args, kwargs, message",
    [
        (_with(q=jnp.zeros((8, 4), jnp.float32)), {}, r"q must be \[T, N, H\]"),
        (_with(v_pages=jnp.zeros((2, 6, 8, 32), jnp.float32)), {}, "v_pages shape"),
        (_with(q=jnp.zeros((8, 4, 16), jnp.bfloat16)), {}, "share one dtype"),
        (_with(q=jnp.zeros((8, 5, 16), jnp.float32)), {}, "multiple of kv heads"),
        (_with(kv_lens=jnp.zeros((3, 1), jnp.int32)), {}, r"kv_lens must be \[S\]"),
        (_with(kv_lens=jnp.zeros((3,), jnp.float32)), {}, "kv_lens must be int32"),
        (_with(page_indices=jnp.zeros((4, 2), jnp.int32)), {}, r"page_indices must be \[S=3"),
        (_with(cu_q_lens=jnp.zeros((3,), jnp.int32)), {}, r"cu_q_lens must have shape \(4,\)"),
        (_with(cu_q_lens=jnp.zeros((4,), jnp.float32)), {}, "cu_q_lens must be int32"),
        (_with(num_seqs=jnp.zeros((), jnp.int32)), {}, r"num_seqs must have shape \(1,\)"),
        (_args(), dict(sliding_window=-3), "sliding_window"),
        (_args(), dict(soft_cap=0.0), "soft_cap"),
        (_args(), dict(block_q=3), "block_q must be a power of two"),
        (_args(), dict(block_kv=24), "block_kv must be a power of two"),
        (_args(), dict(platform="gpu", num_splits=0), "num_splits"),
        (_args(), dict(platform="gpu", block_q=2), r"block_q \* r_pad >= 16"),
        (_args(G=6), dict(platform="gpu"), "power-of-two page size"),
        (_args(), dict(platform="metal"), "platform must be one of"),
        (_args(), dict(platform="gpu", interpret=pltpu.InterpretParams()), "only applies to the TPU variant"),
        (_with(**_INT8), {}, "int8 pages need k_scales and v_scales"),
        (_args(), _SCALES, "only for int8 pages"),
        (_with(**_INT8), {**_SCALES, "k_scales": jnp.ones((2, 6, 1, 1), jnp.float32)}, r"k_scales must have shape"),
    ],
    ids=lambda x: x if isinstance(x, str) else None,
)
def test_validation_errors(args, kwargs, message):
    kwargs.setdefault("interpret", True)
    kwargs.setdefault("platform", "tpu")
    with pytest.raises(ValueError, match=message):
        ragged_paged_attention(**args, **kwargs)


def test_cpu_interpret_defaults_to_tpu_variant():
    if jax.default_backend() != "cpu":
        pytest.skip("only meaningful where the default backend is CPU")
    jaxpr = jax.make_jaxpr(lambda *a: ragged_paged_attention(*a, interpret=True))(*_args().values())
    assert "ragged_paged_attention_tpu" in str(jaxpr)
    assert "ragged_paged_attention_gpu" not in str(jaxpr)
