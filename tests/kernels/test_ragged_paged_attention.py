"""`ragged_paged_attention` kernels (TPU and GPU variants, interpret mode) vs
the reference, plus the wrapper's validation.

As in test_paged_attention.py, CONFIGS samples the product (every (page size,
GQA ratio) pair once) and each config replays several batches through one
compiled kernel: mixed, decode-only, prefill-only, one long prefill, and no
sequences at all, all over NaN-poisoned, shuffled pages.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas.ragged_paged_attention import (
    ragged_paged_attention, reference_ragged_paged_attention)
from kv_cache_builder import (INTERPRET, NUM_KV_HEADS, PAGES_PER_SEQ,
                              TOLERANCE, build_paged_kv, ragged_metadata)

MAX_SEQS = 6

_reference = jax.jit(reference_ragged_paged_attention,
                     static_argnames=("sm_scale", "soft_cap", "sliding_window"))


@dataclasses.dataclass(frozen=True)
class Config:
  page_size: int
  gqa: int  # query heads per kv head
  head_dim: int
  dtype: type
  sliding_window: int | None = None
  soft_cap: float | None = None
  block_q: int | None = None
  # Tokens per kv step; 2 pages (TPU: two DMAs per chunk, so the double
  # buffer sees several chunks) unless set. "default" = the wrapper's choice.
  block_kv: int | str | None = None
  num_splits: int | None = None  # GPU only

  def kv_block(self):
    if self.block_kv == "default":
      return None
    return self.block_kv or max(16, 2 * self.page_size)

  def __str__(self):
    return (f"G{self.page_size}-r{self.gqa}-H{self.head_dim}-"
            f"{jnp.dtype(self.dtype).name}-w{self.sliding_window}-"
            f"c{self.soft_cap}-q{self.block_q}-kv{self.block_kv}-"
            f"s{self.num_splits}")


CONFIGS = [
    Config(8, 1, 64, jnp.float32),
    Config(8, 4, 128, jnp.bfloat16, sliding_window=11),
    Config(8, 8, 64, jnp.float32, soft_cap=20.0),
    Config(16, 1, 128, jnp.bfloat16, block_q=16),
    Config(16, 4, 64, jnp.float32, sliding_window=17, soft_cap=5.0,
           num_splits=1),
    Config(16, 8, 128, jnp.bfloat16, num_splits=3),
    Config(32, 1, 64, jnp.bfloat16, soft_cap=30.0, block_kv="default"),
    Config(32, 4, 128, jnp.float32, block_q=4),
    Config(32, 8, 64, jnp.float32, sliding_window=40),
]


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
      "prefill_only": ([g + 1, g, g - 1, 1, 0, 2], [g + 1, g, g - 1, 1, 0, 2],
                       6),
      "long_prefill": ([top, top, 0, 0, 0, 0], [top, g, 0, 0, 0, 0], 2),
      "no_sequences": ([5, 5, 5, 5, 5, 5], [1, 1, 1, 1, 1, 1], 0),
  }


def _run(config, platform, kv_lens, q_lens, num_seqs, seed, interpret=None):
  rng = np.random.default_rng(seed)
  interpret = INTERPRET[platform] if interpret is None else interpret
  cache = build_paged_kv(rng, kv_lens, num_kv_heads=NUM_KV_HEADS,
                         page_size=config.page_size, head_dim=config.head_dim,
                         pages_per_seq=PAGES_PER_SEQ, dtype=config.dtype)
  kv = np.asarray(cache.kv_lens).copy()
  kv[num_seqs:] = rng.integers(-5, 10_000, MAX_SEQS - num_seqs)
  cu_q_lens, num = ragged_metadata(q_lens, num_seqs, MAX_SEQS, rng)
  q = jnp.asarray(rng.standard_normal(
      (_num_tokens(config.page_size), NUM_KV_HEADS * config.gqa,
       config.head_dim)), config.dtype)
  args = (q, cache.k_pages, cache.v_pages, jnp.asarray(kv, jnp.int32),
          cache.page_indices, cu_q_lens, num)
  options = dict(soft_cap=config.soft_cap,
                 sliding_window=config.sliding_window)
  out = ragged_paged_attention(
      *args, **options, interpret=interpret, platform=platform,
      block_q=config.block_q, block_kv=config.kv_block(),
      num_splits=config.num_splits if platform == "gpu" else None)
  return out, _reference(*args, **options), int(np.sum(q_lens[:num_seqs]))


@pytest.mark.parametrize("platform", ["tpu", "gpu"])
@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_kernel_matches_reference(config, platform):
  scenarios = _scenarios(config.page_size)
  for seed, (name, (kv_lens, q_lens, num_seqs)) in enumerate(scenarios.items()):
    out, ref, live_rows = _run(config, platform, kv_lens, q_lens, num_seqs,
                               seed)
    assert out.dtype == config.dtype and out.shape == ref.shape
    out = np.asarray(out, np.float32)
    ref = np.asarray(ref, np.float32)
    assert np.isfinite(out).all(), f"{name}: NaN/inf leaked from padding"
    assert (out[live_rows:] == 0).all(), f"{name}: padding rows must be zeros"
    tol = TOLERANCE[config.dtype]
    np.testing.assert_allclose(
        out, ref, atol=tol, rtol=tol,
        err_msg=f"scenario {name}: kv_lens {kv_lens}, q_lens {q_lens}")


def test_generic_interpreter_runs_tpu_variant():
  # interpret=True (the generic interpreter) is the documented CPU mode.
  config = CONFIGS[0]
  kv_lens, q_lens, num_seqs = _scenarios(config.page_size)["mixed"]
  out, ref, _ = _run(config, "tpu", kv_lens, q_lens, num_seqs, seed=3,
                     interpret=True)
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-5,
                             rtol=2e-5)


# ----------------------------------------------------------------------------
# Validation


def _args(T=8, N=4, H=16, K=2, P=6, G=8, S=3, pages_per_seq=2,
          dtype=jnp.float32):
  return dict(
      q=jnp.zeros((T, N, H), dtype),
      k_pages=jnp.zeros((K, P, G, H), dtype),
      v_pages=jnp.zeros((K, P, G, H), dtype),
      kv_lens=jnp.zeros((S,), jnp.int32),
      page_indices=jnp.zeros((S, pages_per_seq), jnp.int32),
      cu_q_lens=jnp.zeros((S + 1,), jnp.int32),
      num_seqs=jnp.zeros((1,), jnp.int32))


def _with(**changes):
  args = _args()
  args.update(changes)
  return args


@pytest.mark.parametrize("args, kwargs, message", [
    (_with(q=jnp.zeros((8, 4), jnp.float32)), {}, r"q must be \[T, N, H\]"),
    (_with(v_pages=jnp.zeros((2, 6, 8, 32), jnp.float32)), {},
     "v_pages shape"),
    (_with(q=jnp.zeros((8, 4, 16), jnp.bfloat16)), {}, "share one dtype"),
    (_with(q=jnp.zeros((8, 5, 16), jnp.float32)), {}, "multiple of kv heads"),
    (_with(kv_lens=jnp.zeros((3, 1), jnp.int32)), {}, r"kv_lens must be \[S\]"),
    (_with(kv_lens=jnp.zeros((3,), jnp.float32)), {}, "kv_lens must be int32"),
    (_with(page_indices=jnp.zeros((4, 2), jnp.int32)), {},
     r"page_indices must be \[S=3"),
    (_with(cu_q_lens=jnp.zeros((3,), jnp.int32)), {},
     r"cu_q_lens must have shape \(4,\)"),
    (_with(cu_q_lens=jnp.zeros((4,), jnp.float32)), {},
     "cu_q_lens must be int32"),
    (_with(num_seqs=jnp.zeros((), jnp.int32)), {},
     r"num_seqs must have shape \(1,\)"),
    (_args(), dict(sliding_window=-3), "sliding_window"),
    (_args(), dict(soft_cap=0.0), "soft_cap"),
    (_args(), dict(block_q=3), "block_q must be a power of two"),
    (_args(), dict(block_kv=24), "block_kv must be a power of two"),
    (_args(), dict(platform="gpu", num_splits=0), "num_splits"),
    (_args(), dict(platform="gpu", block_q=2), r"block_q \* r_pad >= 16"),
    (_args(G=6), dict(platform="gpu"), "power-of-two page size"),
    (_args(), dict(platform="metal"), "platform must be one of"),
    (_args(), dict(platform="gpu", interpret=pltpu.InterpretParams()),
     "only applies to the TPU variant"),
], ids=lambda x: x if isinstance(x, str) else None)
def test_validation_errors(args, kwargs, message):
  kwargs.setdefault("interpret", True)
  kwargs.setdefault("platform", "tpu")
  with pytest.raises(ValueError, match=message):
    ragged_paged_attention(**args, **kwargs)


def test_cpu_interpret_defaults_to_tpu_variant():
  if jax.default_backend() != "cpu":
    pytest.skip("only meaningful where the default backend is CPU")
  jaxpr = jax.make_jaxpr(
      lambda *a: ragged_paged_attention(*a, interpret=True))(*_args().values())
  assert "ragged_paged_attention_tpu" in str(jaxpr)
  assert "ragged_paged_attention_gpu" not in str(jaxpr)
