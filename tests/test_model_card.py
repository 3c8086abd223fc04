"""experiments/model_card.py: the loss it reports is the mean next-token cross-entropy (checked against logits whose
cross-entropy is known, and against train_tiny's training loss on a tiny Llama), windows are non-overlapping, and
parameters are counted as the architecture says. No packaged model or corpus is read here."""

import math

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from cbjax.model.config import ModelConfig
from cbjax.model.llama import Llama
from experiments.doc_views import VIEWS
from experiments.model_card import mean_loss, nll_sum, parameter_counts, windows_of

V = 11


def test_uniform_logits_give_log_vocab():
    windows = np.arange(4 * 6).reshape(4, 6) % V
    assert mean_loss(lambda t: jnp.zeros((*t.shape, V)), windows, batch=3) == pytest.approx(math.log(V), rel=1e-6)


def test_bigram_logits_match_a_direct_computation():
    """A forward whose logits depend on the current token only (a bigram table): the loss is computed by hand."""
    rng = np.random.default_rng(0)
    table = rng.normal(size=(V, V)).astype(np.float32) * 3
    windows = rng.integers(0, V, size=(5, 9))  # 5 windows: the last batch of 2 holds one
    logp = table - np.log(np.exp(table).sum(-1, keepdims=True))
    want = -np.mean([logp[w[i], w[i + 1]] for w in windows for i in range(len(w) - 1)])
    total, count = nll_sum(lambda t: jnp.asarray(table)[t], windows, batch=2)
    assert count == 5 * 8
    assert total / count == pytest.approx(want, rel=1e-5)


def tiny_llama() -> Llama:
    cfg = ModelConfig(
        vocab_size=32, hidden_size=16, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=24,
        tie_word_embeddings=True, max_position_embeddings=16, dtype="float32",
    )  # fmt: skip
    return Llama(cfg, nnx.Rngs(0))


def test_loss_of_a_model_equals_train_tiny_loss():
    """The same figure train_tiny's loss_fn would give these windows (optax cross-entropy on forward_full)."""
    model = tiny_llama()
    windows = np.random.default_rng(1).integers(0, 32, size=(3, 9))
    w = jnp.asarray(windows)
    want = float(optax.softmax_cross_entropy_with_integer_labels(model.forward_full(w[:, :-1]), w[:, 1:]).mean())
    assert mean_loss(model.forward_full, windows, batch=2) == pytest.approx(want, rel=1e-5)


def test_windows_are_non_overlapping_and_drop_the_tail():
    w = windows_of(np.arange(23), 5)
    assert w.shape == (4, 5) and w.dtype == np.int32
    np.testing.assert_array_equal(w.ravel(), np.arange(20))


def test_parameter_counts():
    model = tiny_llama()
    v, d, layers, hd, heads, kv, inter = 32, 16, 2, 8, 2, 1, 24
    per_layer = d * heads * hd + 2 * d * kv * hd + heads * hd * d + 3 * d * inter + 2 * d
    assert parameter_counts(model) == (v * d + layers * per_layer + d, v * d)


def test_pivot_view_puts_models_in_columns():
    runs = [
        dict(model="a", measure="loss", value=3.05391),
        dict(model="b", measure="loss", value=3.2),
        dict(model="a", measure="params", value=2361024),
        dict(model="b", measure="params", value=893568),
    ]
    table = VIEWS["pivot"](
        {"runs": runs},
        row="measure",
        column_key="model",
        labels={"params": "parameters", "loss": "loss"},
        formats={"params": "{:,d}", "loss": "{:.3f}"},
    )
    assert table.splitlines() == [
        "|  | a | b |",
        "|---|---|---|",
        "| parameters | 2,361,024 | 893,568 |",
        "| loss | 3.054 | 3.200 |",
    ]
