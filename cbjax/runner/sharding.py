"""Tensor parallelism: the ("data", "model") mesh and where each parameter and KV page lives on it.

Megatron's layout, one rule per kind of weight (the last path element names it):
- column-parallel (output features split over "model"): the fused q|k|v and gate|up projections, the untied LM head;
- row-parallel (input features split): o_proj and down_proj;
- the embedding by vocabulary rows; norms and biases of row-parallel layers replicated;
- int8 weights (cbjax/model/quantize.py) like their float originals, their per-output-channel scales with them.
The KV cache [K, P, G, H] is split by kv heads when "model" divides K, else replicated; attention then runs per
shard under shard_map (kernels_pallas/dispatch.py), each device on its own heads.

The compiled step is one SPMD program: XLA inserts the collectives the layout needs (an all-reduce after each
row-parallel matmul, gathers where a fused projection's q, k and v columns straddle shards; sampling reads the
vocabulary-split logits through XLA's own reductions). Values are identical to one device's up to float rounding
of the reduction order.
"""

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

COLUMN = ("qkv_proj", "gate_up_proj", "lm_head")
ROW = ("o_proj", "down_proj")


def make_mesh(tensor_parallel_size: int, devices=None) -> Mesh:
    """A (1, tensor_parallel_size) ("data", "model") mesh over the first devices."""
    devices = list(devices if devices is not None else jax.devices())
    if tensor_parallel_size > len(devices):
        raise ValueError(
            f"tensor_parallel_size={tensor_parallel_size} needs that many devices; jax sees {len(devices)} "
            "(on a CPU host: XLA_FLAGS=--xla_force_host_platform_device_count=N)"
        )
    return Mesh(np.asarray(devices[:tensor_parallel_size]).reshape(1, tensor_parallel_size), ("data", "model"))


def param_spec(path: tuple[str, ...], shape: tuple[int, ...], model_size: int) -> P:
    """The PartitionSpec of the parameter at `path` (module names, then the parameter's own name)."""
    names = [str(p) for p in path]
    owner, name = (names[-2], names[-1]) if len(names) >= 2 else ("", names[-1])

    def split(axis: int) -> P:
        if shape[axis] % model_size:
            return P()  # not divisible: replicated (correct, just not split)
        spec = [None] * len(shape)
        spec[axis] = "model"
        return P(*spec)

    if owner in COLUMN and name in ("kernel", "kernel_q"):
        return split(1)
    if owner in COLUMN and name in ("scale", "bias"):
        return split(0)
    if owner in ROW and name in ("kernel", "kernel_q"):
        return split(0)
    if owner == "embed" and name in ("embedding", "embedding_q", "scale"):
        return split(0)
    return P()


def shard_params(leaves_with_paths, mesh: Mesh) -> list:
    """Each parameter leaf on the mesh by its rule; returns the placed leaves, in order."""
    size = mesh.shape["model"]
    out = []
    for path, leaf in leaves_with_paths:
        # DictKey('layers'), SequenceKey(0), ..., GetAttrKey('value') -> ('layers', 0, ..., 'kernel')
        keys = tuple(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))) for k in path)
        keys = tuple(k for k in keys if k != "value")
        out.append(put_global(leaf, NamedSharding(mesh, param_spec(keys, leaf.shape, size))))
    return out


def put_global(value, sharding: NamedSharding):
    """`value` (host or local) as an array laid out by `sharding`, whose mesh may span processes: each process
    fills only its own devices' shards (multi-host: every process holds the same host value)."""
    if jax.process_count() == 1:
        return jax.device_put(value, sharding)
    host = np.asarray(value)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def zeros_global(shape, dtype, sharding: NamedSharding):
    """Zeros laid out by `sharding`, made on the devices (no full-size host buffer)."""
    return jax.jit(lambda: jax.numpy.zeros(shape, dtype), out_shardings=sharding)()


def kv_spec(num_kv_heads: int, mesh: Mesh) -> P:
    """Split the cache by kv heads when the model axis divides them, else keep it whole on every device."""
    return P("model") if num_kv_heads % mesh.shape["model"] == 0 else P()
