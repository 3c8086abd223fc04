"""orbax round trips: model parameters, and a training state (params + optax state + step) that resumes exactly."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from cbjax.model import get_model_config, init_model
from cbjax.model.checkpoint import TrainCheckpointer, params_of, restore_params, save_params

CFG = get_model_config("test-tiny").replace(qkv_bias=True, vocab_size=128)


def _assert_trees_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_params_round_trip_into_config_and_into_model(tmp_path):
    src = init_model(CFG, seed=1)
    save_params(str(tmp_path / "p"), src)
    tokens = jnp.asarray([[5, 9, 33, 2, 7]])
    want = np.asarray(src.forward_full(tokens))
    restored = restore_params(str(tmp_path / "p"), CFG)  # a fresh model, never randomly initialised
    _assert_trees_equal(params_of(restored), params_of(src))
    np.testing.assert_array_equal(np.asarray(restored.forward_full(tokens)), want)
    other = init_model(CFG, seed=2)  # different weights, same shapes: overwritten in place
    assert not np.array_equal(np.asarray(other.forward_full(tokens)), want)
    restore_params(str(tmp_path / "p"), other)
    np.testing.assert_array_equal(np.asarray(other.forward_full(tokens)), want)


def test_restore_into_a_model_of_another_shape_is_refused(tmp_path):
    save_params(str(tmp_path / "p"), init_model(CFG, seed=1))
    with pytest.raises(
        ValueError,
        match=r"cannot restore parameters for this model: embed\.embedding is "
        r"\(128, 64\) in the checkpoint, \(128, 32\) in the model",
    ):
        restore_params(str(tmp_path / "p"), CFG.replace(hidden_size=32))
    with pytest.raises(ValueError, match="no such checkpoint directory"):
        restore_params(str(tmp_path / "elsewhere"), CFG)


def _loss(params, graphdef, tokens):
    logits = nnx.merge(graphdef, params).forward_full(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def test_train_state_resume_continues_exactly(tmp_path):
    """Train 4 steps straight vs 2 steps, checkpoint, restore in a fresh process-like setup, 2 more steps: the
    same parameters bit for bit (so the optimizer state, Adam moments and count, came back too)."""
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, CFG.vocab_size, (2, 12)))
    opt = optax.adamw(1e-2)

    graphdef, _ = nnx.split(init_model(CFG, seed=0))

    @jax.jit
    def train_step(params, opt_state):
        grads = jax.grad(_loss)(params, graphdef, tokens)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    def run(params, opt_state, n):
        for _ in range(n):
            params, opt_state = train_step(params, opt_state)
        return params, opt_state

    p0 = params_of(init_model(CFG, seed=0))
    straight, _ = run(p0, opt.init(p0), 4)
    half, half_opt = run(p0, opt.init(p0), 2)
    with TrainCheckpointer(str(tmp_path / "ckpt"), max_to_keep=1) as ck:
        ck.save(1, p0, opt.init(p0))
        ck.save(2, half, half_opt, extra={"data_pos": np.int64(1234)})
        ck.wait()
    with TrainCheckpointer(str(tmp_path / "ckpt")) as ck:
        assert ck.latest_step() == 2
        fresh = params_of(init_model(CFG, seed=5))
        params, opt_state, step, extra = ck.restore(fresh, opt.init(fresh), {"data_pos": np.int64(0)})
    assert step == 2 and int(extra["data_pos"]) == 1234
    _assert_trees_equal(opt_state, half_opt)
    resumed, _ = run(params, opt_state, 2)
    _assert_trees_equal(resumed, straight)


def test_restore_from_an_empty_directory_is_refused(tmp_path):
    with TrainCheckpointer(str(tmp_path / "none")) as ck, pytest.raises(ValueError, match="no checkpoint"):
        ck.restore({}, {})
