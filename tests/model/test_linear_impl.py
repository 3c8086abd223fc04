"""Which matmul the engine's linears run (cbjax/model/linear_impl.py): the packed CPU kernel where it can, XLA's
dot otherwise, and a clear error when "packed" is asked for and cannot be had."""

import jax.numpy as jnp
import pytest
from flax import nnx

from cbjax import LLMEngine
from cbjax.model import get_model_config, init_model, linear_impl
from cbjax.model.packed_linear import PackedLinear
from kernels_pallas.cpu import gemm as cpu_gemm

needs_kernel = pytest.mark.skipif(not cpu_gemm.available(), reason="no C++ compiler: the kernel cannot be built")


@pytest.fixture(scope="module")
def model():
    return init_model(get_model_config("test-tiny"), seed=0)


def test_the_engine_option_and_the_resolver_accept_the_same_names():
    with pytest.raises(ValueError, match="cpu_matmul"):
        LLMEngine("test-tiny", cpu_matmul="mkl")


@needs_kernel
def test_auto_packs_a_float32_model_on_cpu_and_leaves_the_callers_model_alone(model):
    assert linear_impl.resolve_cpu_matmul("auto", model) == "packed"
    served = linear_impl.serving_model(model, None, "auto")
    assert isinstance(served.layers[0].mlp.down_proj, PackedLinear)
    assert isinstance(model.layers[0].mlp.down_proj, nnx.Linear)  # the caller's Llama is unchanged


@needs_kernel
def test_auto_packs_a_bf16_model_where_the_cpu_has_avx512_bf16():
    """matmul_dtype bfloat16: `auto` packs it on the AVX-512 build with AVX512-BF16 (kernels_pallas/cpu/auto.py),
    else keeps XLA's dot; "packed" packs it on any build."""
    from kernels_pallas.cpu import auto, library

    m = init_model(get_model_config("test-tiny").replace(matmul_dtype="bfloat16"), seed=0)
    fast = auto.auto_reason("matmul") is None and library.features()["avx512bf16"]
    assert linear_impl.resolve_cpu_matmul("auto", m) == ("packed" if fast else "xla")
    assert linear_impl.resolve_cpu_matmul("packed", m) == "packed"
    served = linear_impl.serving_model(m, None, "packed")
    assert served.layers[0].mlp.down_proj.kernel_packed.dtype == jnp.bfloat16


def test_xla_and_the_environment_variable(model, monkeypatch):
    assert linear_impl.resolve_cpu_matmul("xla", model) == "xla"
    assert linear_impl.serving_model(model, None, "xla") is model
    monkeypatch.setenv(linear_impl.ENV_VAR, "xla")
    assert linear_impl.resolve_cpu_matmul("packed", model) == "xla"  # the variable wins
    monkeypatch.setenv(linear_impl.ENV_VAR, "fast")
    with pytest.raises(ValueError, match="CBJAX_MATMUL"):
        linear_impl.resolve_cpu_matmul("auto", model)


@pytest.mark.parametrize(
    "kind, match",
    [("f16", "only float32 or bfloat16 linears"), ("int8", "no nnx.Linear"), ("tp", "tensor parallelism")],
)
def test_what_cannot_be_packed_keeps_xla_under_auto_and_is_refused_under_packed(kind, match):
    cfg = get_model_config("test-tiny")
    if kind == "f16":
        m = init_model(cfg.replace(matmul_dtype="float16"), seed=0)
    else:
        m = init_model(cfg, seed=0)
    if kind == "int8":
        m = linear_impl.serving_model(m, "int8", "auto")
    tp = 2 if kind == "tp" else 1
    assert linear_impl.resolve_cpu_matmul("auto", m, tp) == "xla"
    with pytest.raises(ValueError, match=match):
        linear_impl.resolve_cpu_matmul("packed", m, tp)
