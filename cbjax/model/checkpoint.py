"""orbax-checkpoint save/restore: a model's parameters, and a training state (params + optax state + step).

Parameters are stored as the NNX state's pure dict (nested dicts of arrays), so a checkpoint does not depend on the
module classes; restoring always goes through an abstract target, which gives back the exact pytree structure
(optax's named tuples included) and dtypes, and refuses a checkpoint of another shape.
"""

import os

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from cbjax.model.config import ModelConfig
from cbjax.model.llama import Llama, abstract_model


def params_of(model: Llama) -> dict:
    """The model's parameters as a pure nested dict of arrays (what is saved and what optax trains)."""
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def set_params(model: Llama, params: dict) -> Llama:
    """Write a pure params dict (as from params_of) into the model, in place; returns the model."""
    state = nnx.state(model, nnx.Param)
    nnx.replace_by_pure_dict(state, params)
    nnx.update(model, state)
    return model


def _abstract(tree):
    # numpy scalars (np.int64(3)) are not orbax leaves; 0-d arrays are.
    return jax.tree.map(
        lambda x: ocp.utils.to_shape_dtype_struct(np.asarray(x) if isinstance(x, np.generic) else x), tree
    )


def save_params(path: str, model: Llama) -> None:
    """Save the model's parameters to the directory `path` (replaced if it exists)."""
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(os.path.abspath(path), params_of(model), force=True)


def restore_params(path: str, model_or_config: "Llama | ModelConfig") -> Llama:
    """A model with the parameters saved at `path`: restored into `model` (in place), or into a new model of
    `config` that is never randomly initialised."""
    if isinstance(model_or_config, ModelConfig):
        cfg = model_or_config
        model = abstract_model(cfg)
    else:
        model = model_or_config
    target = _abstract(params_of(model))
    path = os.path.abspath(path)
    if not os.path.isdir(path):
        raise ValueError(f"{path}: no such checkpoint directory")
    with ocp.StandardCheckpointer() as ckptr:
        # Compare shapes from the metadata first: a restore that fails inside orbax leaves its async readers behind.
        try:
            saved = {
                ".".join(str(getattr(k, "key", k)) for k in p): tuple(m.shape)
                for p, m in jax.tree_util.tree_leaves_with_path(ckptr.metadata(path).item_metadata)
            }
        except (ValueError, FileNotFoundError) as e:
            raise ValueError(f"{path}: not a parameter checkpoint ({e})") from None
        wanted = {
            ".".join(str(getattr(k, "key", k)) for k in p): tuple(a.shape)
            for p, a in jax.tree_util.tree_leaves_with_path(target)
        }
        if saved != wanted:
            diff = sorted(k for k in saved.keys() | wanted.keys() if saved.get(k) != wanted.get(k))
            raise ValueError(
                f"{path}: cannot restore parameters for this model: {diff[0]} is "
                f"{saved.get(diff[0], 'absent')} in the checkpoint, {wanted.get(diff[0], 'absent')} "
                f"in the model ({len(diff)} parameters differ)"
            )
        params = ckptr.restore(path, target)
    if isinstance(model_or_config, ModelConfig):
        graphdef, state = nnx.split(model)
        nnx.replace_by_pure_dict(state, params)
        return nnx.merge(graphdef, state)
    return set_params(model, params)


class TrainCheckpointer:
    """Step-numbered training checkpoints in one directory, keeping the newest `max_to_keep`; saves are
    asynchronous (training goes on while the previous state is written)."""

    def __init__(self, directory: str, max_to_keep: int = 2):
        self.directory = os.path.abspath(directory)
        self._mngr = ocp.CheckpointManager(
            self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True)
        )

    def latest_step(self) -> int | None:
        return self._mngr.latest_step()

    def save(self, step: int, params, opt_state, extra: dict | None = None) -> None:
        """Save params, optimizer state and step (and `extra`: small arrays such as a data-loader position)."""
        extra = {k: np.asarray(v) for k, v in (extra or {}).items()}
        state = {"params": params, "opt_state": opt_state, "step": step, "extra": extra}
        self._mngr.save(step, args=ocp.args.StandardSave(state))

    def restore(self, params_like, opt_state_like, extra_like: dict | None = None, step: int | None = None):
        """(params, opt_state, step, extra) of `step` (default: the latest), shaped like the `*_like` pytrees."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise ValueError(f"{self.directory}: no checkpoint to restore")
        target = _abstract({"params": params_like, "opt_state": opt_state_like, "step": 0, "extra": extra_like or {}})
        r = self._mngr.restore(step, args=ocp.args.StandardRestore(target))
        return r["params"], r["opt_state"], int(r["step"]), r["extra"]

    def wait(self) -> None:
        self._mngr.wait_until_finished()

    def close(self) -> None:
        self._mngr.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
