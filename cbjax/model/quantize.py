"""Weight-only int8 quantization: every linear layer and the LM head (or the tied embedding) stored as int8 with one
float32 scale per output channel; activations and accumulation stay in the model's dtype / float32.

Symmetric absmax per output channel (w ~ q * s, q in [-127, 127], s = max|w| / 127), the scheme of weight-only int8
in vLLM, TensorRT-LLM and qwix's `QtRule(weight_qtype=int8)`. Written here rather than through qwix because our
model's linears are few and known (fused qkv and gate/up, o, down, the LM head or the tied embedding): replacing
those modules is 100 lines with no interception of jax ops, the quantized state is plain int8 + float32 arrays
that the runner splits, places and compiles like any other, and the tied embedding (tinypy's LM head) needs a
per-row scheme that serves both the lookup and the logits.

The dot converts the int8 weight to the activation dtype inside the compiled step; XLA:CPU materialises that
conversion, so int8 saves memory, not time, on this CPU (docs/memory.md has the figures).
"""

import jax.numpy as jnp
import numpy as np
from flax import nnx

from cbjax.config.model import QUANTIZATIONS


def quantize_rows(w: np.ndarray, axis: int) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric absmax int8 of w with one scale per index of `axis` kept (the others reduced): (q int8, scale f32).
    An all-zero channel gets scale 1 (its q is 0)."""
    w = np.asarray(w, np.float32)
    reduce = tuple(i for i in range(w.ndim) if i != axis % w.ndim)
    scale = np.max(np.abs(w), axis=reduce) / 127.0
    scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
    shape = [1] * w.ndim
    shape[axis] = -1
    q = np.clip(np.rint(w / scale.reshape(shape)), -127, 127).astype(np.int8)
    return q, scale


class Int8Linear(nnx.Module):
    """y = (x @ q) * scale (+ bias): q [din, dout] int8, scale [dout] f32. Same call as the nnx.Linear it replaces."""

    def __init__(self, linear: nnx.Linear):
        q, scale = quantize_rows(np.asarray(linear.kernel[...]), axis=1)
        self.kernel_q = nnx.Param(jnp.asarray(q))
        self.scale = nnx.Param(jnp.asarray(scale))
        self.bias = None if linear.bias is None else nnx.Param(linear.bias[...])
        self.dtype = linear.dtype or jnp.float32  # the activations' dtype at the dot

    def __call__(self, x):
        w = self.kernel_q[...].astype(self.dtype)
        y = jnp.dot(x.astype(self.dtype), w, preferred_element_type=jnp.float32) * self.scale[...]
        if self.bias is not None:
            y = y + self.bias[...].astype(jnp.float32)
        return y.astype(x.dtype)


class Int8Embed(nnx.Module):
    """A (tied) embedding as int8 rows with one scale per token: the lookup dequantizes its rows, `attend` (the tied
    LM head) is (h @ q^T) * scale, per output channel like the linears."""

    def __init__(self, embed: nnx.Embed):
        q, scale = quantize_rows(np.asarray(embed.embedding[...]), axis=0)
        self.embedding_q = nnx.Param(jnp.asarray(q))
        self.scale = nnx.Param(jnp.asarray(scale))
        self.dtype = embed.dtype or jnp.float32

    def __call__(self, tokens):
        rows = jnp.take(self.embedding_q[...], tokens, axis=0).astype(jnp.float32)
        return (rows * jnp.take(self.scale[...], tokens)[..., None]).astype(self.dtype)

    def attend(self, hidden):
        w = self.embedding_q[...].astype(self.dtype)
        return jnp.dot(hidden.astype(self.dtype), w.T, preferred_element_type=jnp.float32) * self.scale[...]


def quantize_model(model, method: str = "int8"):
    """Replace the model's linear layers (and its LM head: the tied embedding when the head is tied) by int8 ones,
    in place; returns the model. ValueError for an unknown method or a model with nothing left to quantize."""
    if method not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {list(QUANTIZATIONS)} or None, got {method!r}")
    linears = [
        (module, name)
        for module in (*(layer.attn for layer in model.layers), *(layer.mlp for layer in model.layers), model)
        for name, value in list(vars(module).items())
        if isinstance(value, nnx.Linear)
    ]
    if not linears:
        raise ValueError("quantization='int8': the model has no floating-point linear layers to quantize")
    for module, name in linears:
        setattr(module, name, Int8Linear(getattr(module, name)))
    if model.cfg.tie_word_embeddings and isinstance(model.embed, nnx.Embed):
        model.embed = Int8Embed(model.embed)
    return model


def linear_weight_bytes(model) -> int:
    """Bytes of the weights quantization shrinks: the linear layers' and the LM head's (the embedding, when the head
    is tied to it), scales included; norms and biases are left out."""
    tied = model.cfg.tie_word_embeddings
    total = 0
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        owner, name = path[-2], path[-1]
        if name in ("weight", "bias") or (owner == "embed" and not tied):
            continue
        arr = var.get_value()
        total += int(np.prod(arr.shape)) * jnp.dtype(arr.dtype).itemsize
    return total
