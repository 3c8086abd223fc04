"""Weight-only int8 (cbjax/model/quantize.py): the quantizer, the int8 modules against their float originals, and
the engine in int8 mode (close to float32 on held-out text, nothing compiled after warmup, bad options refused)."""

import glob
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from cbjax import LLM, LLMEngine, SamplingParams
from cbjax.model import get_model_config, init_model
from cbjax.model.quantize import Int8Embed, Int8Linear, linear_weight_bytes, quantize_model, quantize_rows
from tests.helpers import ROOT


def test_quantize_rows_is_within_half_a_step_per_channel():
    w = np.random.default_rng(0).standard_normal((64, 32)).astype(np.float32)
    w[:, 5] = 0.0  # an all-zero channel
    q, scale = quantize_rows(w, axis=1)
    assert q.dtype == np.int8 and scale.shape == (32,) and np.abs(q).max() <= 127
    assert np.all(np.abs(q * scale - w) <= scale / 2 + 1e-7)
    assert scale[5] == 1.0 and not q[:, 5].any()
    assert np.all(np.abs(q).max(axis=0)[np.arange(32) != 5] == 127)  # the range is used


def test_int8_modules_match_the_float_ones():
    rngs = nnx.Rngs(0)
    lin = nnx.Linear(48, 24, use_bias=True, rngs=rngs, bias_init=nnx.initializers.normal(0.5))
    emb = nnx.Embed(100, 48, rngs=rngs)
    x = jax.random.normal(jax.random.key(1), (5, 48))
    want, got = np.asarray(lin(x)), np.asarray(Int8Linear(lin)(x))
    assert np.abs(got - want).max() < 0.02 * np.abs(want).max()
    q = Int8Embed(emb)
    tokens = jnp.asarray([0, 7, 99])
    np.testing.assert_allclose(
        np.asarray(q(tokens)), np.asarray(emb(tokens)), atol=0.01 * float(np.abs(emb(tokens)).max())
    )
    want, got = np.asarray(emb.attend(x)), np.asarray(q.attend(x))
    assert np.abs(got - want).max() < 0.02 * np.abs(want).max()


def held_out_windows(tokenizer, n=8, length=129):
    """Python source the packaged model never saw in training (it was trained on the standard library)."""
    ids = []
    for path in sorted(glob.glob(os.path.join(ROOT, "cbjax", "core", "*.py"))):
        with open(path, encoding="utf-8") as f:
            ids += tokenizer.encode(f.read())
    return np.asarray(ids[: n * length], np.int32).reshape(n, length)


def loss(model, windows):
    logp = jax.nn.log_softmax(model.forward_full(jnp.asarray(windows[:, :-1])), axis=-1)
    return float(-jnp.take_along_axis(logp, jnp.asarray(windows[:, 1:, None]), axis=-1).mean())


@pytest.fixture(scope="module")
def engines():
    opts = dict(warmup="full", max_num_seqs=8, max_num_batched_tokens=64)  # few token buckets: quick to warm up
    return LLM("tinypy", **opts), LLM("tinypy", quantization="int8", **opts)


def test_int8_tinypy_keeps_its_loss_and_its_greedy_tokens(engines):
    f32, int8 = engines
    windows = held_out_windows(f32.engine.tokenizer)
    delta = loss(int8.engine.model, windows) - loss(f32.engine.model, windows)
    assert abs(delta) < 0.02  # nats/token (docs/memory.md: +0.0002 over the 122 held-out windows)
    prompts = [w[:24].tolist() for w in windows]
    compiles = int8.engine.num_compiles
    sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in f32.generate(prompts, sp)]
    got = [o.outputs[0].token_ids for o in int8.generate(prompts, sp)]
    assert int8.engine.num_compiles == compiles  # nothing compiled after warmup in int8 mode
    # Teacher-forced: int8's argmax at every position of float32's continuation (one divergence counts once).
    seqs = np.asarray([p + c for p, c in zip(prompts, ref)])
    pred = np.asarray(jnp.argmax(int8.engine.model.forward_full(jnp.asarray(seqs)), axis=-1))
    assert np.mean(pred[:, 23:-1] == seqs[:, 24:]) >= 0.95
    assert sum(a == b for a, b in zip(ref, got)) >= len(ref) // 2  # and the engine really runs the int8 model
    assert linear_weight_bytes(int8.engine.model) / linear_weight_bytes(f32.engine.model) < 0.27


def test_a_model_passed_in_is_not_changed_and_bad_options_are_refused():
    model = init_model(get_model_config("test-tiny"), seed=0)
    engine = LLMEngine(model, quantization="int8", warmup="none", max_model_len=64, num_pages=16)
    assert isinstance(engine.model.layers[0].attn.qkv_proj, Int8Linear)
    assert isinstance(model.layers[0].attn.qkv_proj, nnx.Linear)  # the caller's model stays float
    with pytest.raises(ValueError, match=r"quantization must be one of \[None, 'int8'\], got 'int4'"):
        LLMEngine(model, quantization="int4")
    with pytest.raises(ValueError, match="no floating-point linear layers to quantize"):
        quantize_model(engine.model)
