"""Placement: where a runner's arrays live, and its model's parameters placed there.

Three places: jax's default device (nothing is moved), one given device (each replica of a data-parallel engine,
cbjax/data_parallel.py, gets its own), or a ("data", "model") mesh (tensor parallelism: each parameter split by its
rule, sharding.py). A runner's parameters, KV pages, pending tokens and step programs all follow its placement.
"""

import dataclasses
from typing import NamedTuple

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from cbjax.model.llama import Llama
from cbjax.runner import sharding
from cbjax.runner.compilation.static_arg import Static, intern


@dataclasses.dataclass(frozen=True)
class Placement:
    """A device, a mesh, or neither (jax's default device); never both."""

    device: "jax.Device | None" = None
    mesh: Mesh | None = None

    def __post_init__(self):
        if self.device is not None and self.mesh is not None:
            raise ValueError("a runner takes a device or a mesh, not both")

    @property
    def placed(self) -> bool:
        """Whether arrays are placed explicitly (then programs are lowered for their shardings; else for jax's
        default device, as an unplaced array is)."""
        return self.device is not None or self.mesh is not None

    @property
    def on_default_device(self) -> bool:
        """Whether everything lives on jax's first device (what a program saved on disk may run on)."""
        return self.mesh is None and (self.device is None or self.device == jax.devices()[0])

    @property
    def global_inputs(self) -> bool:
        """Several processes share the mesh (multi-host, jax.distributed): a step's host inputs become global arrays."""
        return self.mesh is not None and jax.process_count() > 1

    def put(self, value):
        """`value` where this placement keeps it: replicated over the mesh, on the device, or as it is."""
        if self.mesh is not None:
            return sharding.put_global(value, NamedSharding(self.mesh, PartitionSpec()))
        return value if self.device is None else jax.device_put(value, self.device)

    def abstract(self, tree):
        """The shapes and dtypes of `tree`'s arrays (with their shardings when placed): programs are lowered from
        these, never from live arrays (the serving thread donates the KV cache while a background thread builds)."""
        placed = self.placed
        return jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding if placed else None), tree
        )


class PlacedParams(NamedTuple):
    """A model split for the step programs: its state as a flat list of placed arrays, and the static rest."""

    leaves: list  # the nnx state's leaves, in treedef order, placed
    graphdef: Static  # interned (nnx GraphDef, treedef of the state): a static argument of every step program


def place_params(model: Llama, placement: Placement) -> PlacedParams:
    """`model`'s parameters where `placement` says: on a mesh each split by its rule (sharding.py), else whole."""
    graphdef, state = nnx.split(model)
    # Flattened once: flattening an nnx.State sorts its keys, which cost ~1 ms per step on the host.
    leaves_with_paths, treedef = jax.tree_util.tree_flatten_with_path(state)
    if placement.mesh is not None:
        leaves = sharding.shard_params(leaves_with_paths, placement.mesh)
    else:
        leaves = placement.put([leaf for _, leaf in leaves_with_paths])
    return PlacedParams(leaves, intern((graphdef, treedef)))
