"""Linear layers with their weights pre-packed for the CPU matmul kernel (kernels_pallas/cpu/gemm.py): float32, or
bfloat16 (a model with matmul_dtype bfloat16: bf16 weights and matmul inputs, float32 sums, as nnx.Linear runs them).

At decode sizes a step's matmuls are bound by reading the weights; XLA:CPU's dot re-packs every weight matrix on
every call. `pack_model` lays each linear's kernel out once, at load time, as the kernel's panels [ceil(N / 32),
K, 32], and `PackedLinear` calls the FFI kernel on them. Same call and same float32 output as the nnx.Linear it
replaces; the packed kernel is an ordinary nnx.Param, so the runner places and donates it like any other.

Float32 and bfloat16 linears (each linear's kernel and compute dtype the same); an int8 model keeps its own
linears (`pack_model` refuses it). The tied embedding (the
LM head of a model with tie_word_embeddings) is left alone: its [V, D] table also serves the token lookup.
The packed kernel's name (`kernel_packed`) matches no tensor-parallel sharding rule (cbjax/runner/sharding.py),
so it stays replicated; the kernel itself runs on one host's CPU.
"""

import jax.numpy as jnp
import numpy as np
from flax import nnx

from kernels_pallas.cpu import gemm as cpu_gemm

# The dtypes the kernel packs (a linear's kernel and compute dtype, both the same).
PACKABLE_DTYPES = ("float32", "bfloat16")
# The linears of a Llama layer (and the model's untied LM head), by attribute name.
_ATTN = ("qkv_proj", "o_proj")
_MLP = ("gate_up_proj", "down_proj")


def _dtypes(linear: nnx.Linear) -> set[str]:
    """The dtypes of a linear's kernel, compute dtype and bias."""
    kernel = linear.kernel[...]
    dtypes = {str(jnp.dtype(kernel.dtype)), str(jnp.dtype(linear.dtype or kernel.dtype))}
    if linear.bias is not None:
        dtypes.add(str(jnp.dtype(linear.bias[...].dtype)))
    return dtypes


def _sums_in_float32(linear: nnx.Linear) -> bool:
    """Whether the linear's dot sums into float32 (the packed kernel always does; a bf16 -> bf16 linear would
    round its output to bf16)."""
    pet = getattr(linear, "preferred_element_type", None)
    return pet is not None and jnp.dtype(pet) == jnp.float32


class PackedLinear(nnx.Module):
    """y = packed_matmul(x, kernel) (+ bias), float32 output: the nnx.Linear it is built from, with its kernel packed.
    A bfloat16 linear casts x to bf16 and sums in float32 (nnx.Linear with preferred_element_type float32)."""

    def __init__(self, linear: nnx.Linear):
        kernel = linear.kernel[...]
        dtypes = _dtypes(linear)
        if len(dtypes) != 1 or not dtypes <= set(PACKABLE_DTYPES):
            raise ValueError(
                f"PackedLinear takes a float32 or bfloat16 nnx.Linear (one dtype throughout), got dtypes "
                f"{sorted(dtypes)}"
            )
        if dtypes == {"bfloat16"} and not _sums_in_float32(linear):
            raise ValueError("PackedLinear takes a bfloat16 nnx.Linear that sums in float32 (preferred_element_type)")
        self.compute_dtype = jnp.dtype(kernel.dtype)
        self.out_features = kernel.shape[1]  # the real columns (the last panel is zero-padded to 32)
        self.kernel_packed = nnx.Param(jnp.asarray(cpu_gemm.pack_weight(np.asarray(kernel))))
        self.bias = None if linear.bias is None else nnx.Param(linear.bias[...])

    # cbjax/model/llama.py's `project` passes a padded batch's real row count to linears that declare this.
    skips_padding_rows = True

    def __call__(self, x, valid_rows=None):
        """`valid_rows` (int32, may be traced): x's rows from there on are padding; their outputs are zeros and
        are not computed (cpu_gemm.packed_matmul)."""
        w = self.kernel_packed[...]
        y = cpu_gemm.packed_matmul(x.astype(self.compute_dtype), w, self.out_features, valid_rows=valid_rows)
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
        return cpu_gemm.packed_matmul_argmax(x.astype(self.compute_dtype), w, self.out_features, valid_rows=valid_rows)


def _linears(model) -> list[tuple[object, str]]:
    """(owner module, attribute) of every nnx.Linear `pack_model` replaces."""
    owners = [(layer.attn, _ATTN) for layer in model.layers] + [(layer.mlp, _MLP) for layer in model.layers]
    if not model.cfg.tie_word_embeddings:
        owners.append((model, ("lm_head",)))
    return [(m, name) for m, names in owners for name in names if isinstance(getattr(m, name, None), nnx.Linear)]


def linear_dtypes(model) -> set[str]:
    """The dtypes of the linears `pack_model` would pack (kernels, compute dtypes and biases)."""
    return {d for module, name in _linears(model) for d in _dtypes(getattr(module, name))}


def unpackable_reason(model) -> str | None:
    """Why `pack_model` would refuse this model (no nnx.Linear to pack, or one whose kernel, compute dtype and
    bias are not all float32 or all bfloat16), or None if it can pack it (the kernel's availability aside)."""
    found = _linears(model)
    if not found:
        return "the model has no nnx.Linear layers to pack (int8-quantized or packed already)"
    for module, name in found:
        linear = getattr(module, name)
        dtypes = _dtypes(linear)
        if len(dtypes) != 1 or not dtypes <= set(PACKABLE_DTYPES):
            return f"only float32 or bfloat16 linears (one dtype each) are packed; this model's use {sorted(dtypes)}"
        if dtypes == {"bfloat16"} and not _sums_in_float32(linear):
            return "a bfloat16 linear is packed only when it sums in float32 (preferred_element_type)"
    return None


def pack_model(model):
    """Replace the model's float32 or bfloat16 linears (qkv_proj, o_proj, gate_up_proj, down_proj and the untied
    lm_head) by PackedLinear, in place; returns the model. Checks everything before it changes anything:
    ValueError for a model with a linear of another dtype (or mixed dtypes within one) or none left to pack (int8,
    or packed already); RuntimeError if the kernel cannot be built here (`cpu_gemm.available()`)."""
    reason = unpackable_reason(model)
    if reason is not None:
        raise ValueError(f"pack_model: {reason}")
    if not cpu_gemm.available():
        raise RuntimeError(f"pack_model: the CPU packed matmul kernel is unavailable: {cpu_gemm.unavailable_reason()}")
    for module, name in _linears(model):
        setattr(module, name, PackedLinear(getattr(module, name)))
    return model
