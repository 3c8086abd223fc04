"""Float32 linear layers with their weights pre-packed for the CPU matmul kernel (kernels_pallas/cpu/gemm.py).

At decode sizes a step's matmuls are bound by reading the weights; XLA:CPU's dot re-packs every weight matrix on
every call. `pack_model` lays each linear's kernel out once, at load time, as the kernel's panels [ceil(N / 32),
K, 32], and `PackedLinear` calls the FFI kernel on them. Same call and same float32 output as the nnx.Linear it
replaces; the packed kernel is an ordinary nnx.Param, so the runner places and donates it like any other.

Float32 only: a bfloat16 or int8 model keeps its own linears (`pack_model` refuses it). The tied embedding (the
LM head of a model with tie_word_embeddings) is left alone: its [V, D] table also serves the token lookup.
The packed kernel's name (`kernel_packed`) matches no tensor-parallel sharding rule (cbjax/runner/sharding.py),
so it stays replicated; the kernel itself runs on one host's CPU.
"""

import jax.numpy as jnp
import numpy as np
from flax import nnx

from kernels_pallas.cpu import gemm as cpu_gemm

# The linears of a Llama layer (and the model's untied LM head), by attribute name.
_ATTN = ("qkv_proj", "o_proj")
_MLP = ("gate_up_proj", "down_proj")


class PackedLinear(nnx.Module):
    """y = packed_matmul(x, kernel) (+ bias), float32: the nnx.Linear it is built from, with its kernel packed."""

    def __init__(self, linear: nnx.Linear):
        kernel = linear.kernel[...]
        dtypes = {jnp.dtype(kernel.dtype), jnp.dtype(linear.dtype or kernel.dtype)}
        if linear.bias is not None:
            dtypes.add(jnp.dtype(linear.bias[...].dtype))
        if dtypes != {jnp.dtype(jnp.float32)}:
            raise ValueError(f"PackedLinear takes a float32 nnx.Linear, got dtypes {sorted(map(str, dtypes))}")
        self.out_features = kernel.shape[1]  # the real columns (the last panel is zero-padded to 32)
        self.kernel_packed = nnx.Param(jnp.asarray(cpu_gemm.pack_weight(np.asarray(kernel))))
        self.bias = None if linear.bias is None else nnx.Param(linear.bias[...])

    # cbjax/model/llama.py's `project` passes a padded batch's real row count to linears that declare this.
    skips_padding_rows = True

    def __call__(self, x, valid_rows=None):
        """`valid_rows` (int32, may be traced): x's rows from there on are padding; their outputs are zeros and
        are not computed (cpu_gemm.packed_matmul)."""
        w = self.kernel_packed[...]
        y = cpu_gemm.packed_matmul(x.astype(jnp.float32), w, self.out_features, valid_rows=valid_rows)
        if self.bias is not None:
            y = y + self.bias[...]
        return y

    @property
    def fuses_argmax(self) -> bool:
        """Whether `argmax` is available: the product's argmax is the output's only without a bias."""
        return self.bias is None

    def argmax(self, x, valid_rows=None):
        """argmax over the output columns of self(x), int32 [...], without materialising the output (the greedy
        LM head: cpu_gemm.packed_matmul_argmax; the values it compares are self(x)'s, bit for bit)."""
        if not self.fuses_argmax:
            raise ValueError("PackedLinear.argmax: a linear with a bias has no fused argmax")
        w = self.kernel_packed[...]
        return cpu_gemm.packed_matmul_argmax(x.astype(jnp.float32), w, self.out_features, valid_rows=valid_rows)


def _linears(model) -> list[tuple[object, str]]:
    """(owner module, attribute) of every nnx.Linear `pack_model` replaces."""
    owners = [(layer.attn, _ATTN) for layer in model.layers] + [(layer.mlp, _MLP) for layer in model.layers]
    if not model.cfg.tie_word_embeddings:
        owners.append((model, ("lm_head",)))
    return [(m, name) for m, names in owners for name in names if isinstance(getattr(m, name, None), nnx.Linear)]


def unpackable_reason(model) -> str | None:
    """Why `pack_model` would refuse this model (no float32 nnx.Linear to pack, or one that is not float32), or
    None if it can pack it (the kernel's availability aside)."""
    found = _linears(model)
    if not found:
        return "the model has no nnx.Linear layers to pack (int8-quantized or packed already)"
    dtypes = set()
    for module, name in found:
        linear = getattr(module, name)
        dtypes |= {str(jnp.dtype(d)) for d in (linear.kernel[...].dtype, linear.dtype) if d is not None}
    if dtypes - {"float32"}:
        return f"only float32 linears are packed; this model's use {sorted(dtypes)}"
    return None


def pack_model(model):
    """Replace the model's float32 linears (qkv_proj, o_proj, gate_up_proj, down_proj and the untied lm_head) by
    PackedLinear, in place; returns the model. Checks everything before it changes anything: ValueError for a
    model with a non-float32 linear (bfloat16 weights or matmul dtype) or none left to pack (int8, or packed
    already); RuntimeError if the kernel cannot be built here (`cpu_gemm.available()`)."""
    reason = unpackable_reason(model)
    if reason is not None:
        raise ValueError(f"pack_model: {reason}")
    if not cpu_gemm.available():
        raise RuntimeError(f"pack_model: the CPU packed matmul kernel is unavailable: {cpu_gemm.unavailable_reason()}")
    for module, name in _linears(model):
        setattr(module, name, PackedLinear(getattr(module, name)))
    return model
