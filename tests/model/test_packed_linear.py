"""PackedLinear and pack_model (cbjax/model/packed_linear.py): a float32 or bfloat16 model's linears on the packed
CPU matmul give the same logits as the nnx.Linear originals; other models are refused."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from cbjax.model import get_model_config, init_model
from cbjax.model.packed_linear import PackedLinear, pack_model
from cbjax.model.quantize import quantize_model
from kernels_pallas.cpu import gemm as cpu_gemm

needs_kernel = pytest.mark.skipif(
    not cpu_gemm.available(), reason=f"FFI kernel unavailable: {cpu_gemm.unavailable_reason()}"
)


@needs_kernel
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_the_linear(bias):
    lin = nnx.Linear(40, 70, use_bias=bias, rngs=nnx.Rngs(0), bias_init=nnx.initializers.normal(0.5))
    x = jax.random.normal(jax.random.key(1), (2, 3, 40))
    packed = PackedLinear(lin)
    assert isinstance(packed.kernel_packed, nnx.Param) and packed.kernel_packed.shape == (3, 40, cpu_gemm.NR)
    got, want = packed(x), lin(x)
    assert got.shape == want.shape and got.dtype == want.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("bias", [False, True])
def test_packed_bf16_linear_matches_the_linear(bias):
    """A bf16 linear summing in float32 (as cbjax/model/llama.py builds them): x cast to bf16, float32 output."""
    lin = nnx.Linear(41, 70, use_bias=bias, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0),
                     bias_init=nnx.initializers.normal(0.5), preferred_element_type=jnp.float32)  # fmt: skip
    x = jax.random.normal(jax.random.key(1), (2, 3, 41))
    packed = PackedLinear(lin)
    assert packed.kernel_packed.shape == (3, 21, cpu_gemm.NR, 2) and packed.kernel_packed.dtype == jnp.bfloat16
    got, want = packed(x), lin(x)
    assert got.shape == want.shape and got.dtype == want.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    if not bias:
        np.testing.assert_array_equal(np.asarray(packed.argmax(x)), np.argmax(np.asarray(got), axis=-1))


def test_packed_linear_refuses_other_dtypes():
    lin = nnx.Linear(8, 8, dtype=jnp.float16, param_dtype=jnp.float16, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"float32 or bfloat16 nnx\.Linear"):
        PackedLinear(lin)
    mixed = nnx.Linear(8, 8, dtype=jnp.bfloat16, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"one dtype throughout"):
        PackedLinear(mixed)
    bf16_out = nnx.Linear(8, 8, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"sums in float32"):
        PackedLinear(bf16_out)


@needs_kernel
@pytest.mark.parametrize("tied", [False, True])
def test_packed_model_gives_the_same_logits(tied):
    cfg = get_model_config("test-tiny").replace(qkv_bias=True, tie_word_embeddings=tied)
    model = init_model(cfg, seed=0)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (3, 19)), jnp.int32)
    want = np.asarray(jax.jit(lambda t: model.forward_full(t))(tokens))
    assert pack_model(model) is model
    layer = model.layers[0]
    for m in (layer.attn.qkv_proj, layer.attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
        assert isinstance(m, PackedLinear)
    assert isinstance(model.embed, nnx.Embed)  # the (tied) embedding is left alone
    assert tied or isinstance(model.lm_head, PackedLinear)
    assert layer.attn.qkv_proj.bias is not None
    graphdef, state = nnx.split(model)  # the packed kernels are ordinary params: split, merge, jit as before
    fwd = jax.jit(lambda s, t: nnx.merge(graphdef, s).forward_full(t))
    got = np.asarray(fwd(state, tokens))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    with pytest.raises(ValueError, match=r"no nnx\.Linear layers to pack"):
        pack_model(model)


@needs_kernel
def test_packed_bf16_model_gives_the_same_logits():
    """matmul_dtype bfloat16: the packed kernel's float32 sums of the same bf16 products as XLA's dot, so the
    logits agree to float32 rounding (the summation orders differ)."""
    cfg = get_model_config("test-tiny").replace(matmul_dtype="bfloat16")
    model = init_model(cfg, seed=0)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (3, 19)), jnp.int32)
    want = np.asarray(jax.jit(lambda t: model.forward_full(t))(tokens))
    pack_model(model)
    assert isinstance(model.lm_head, PackedLinear) and model.lm_head.kernel_packed.dtype == jnp.bfloat16
    got = np.asarray(jax.jit(lambda t: model.forward_full(t))(tokens))
    # A bf16 rounding of an activation that sits on a rounding boundary can flip with the f32 sum's last bit and
    # move a logit by bf16's relative step (2^-8) of its input's contribution: a loose bound on a small model.
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2 * np.abs(want).max())
    assert np.mean(np.abs(got - want) <= 1e-4 * np.abs(want).max()) > 0.9  # nearly all agree to f32 rounding


def test_pack_model_refuses_float16_and_int8_models():
    cfg = get_model_config("test-tiny")
    f16 = init_model(cfg.replace(matmul_dtype="float16"), seed=0)
    with pytest.raises(ValueError, match="only float32 or bfloat16 linears"):
        pack_model(f16)
    assert isinstance(f16.layers[0].attn.qkv_proj, nnx.Linear)  # nothing half-packed
    with pytest.raises(ValueError, match=r"no nnx\.Linear layers to pack"):
        pack_model(quantize_model(init_model(cfg, seed=0)))
