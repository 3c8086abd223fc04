"""How the engine runs a model's linear layers: as loaded (XLA's dot), weight-only int8 (quantize.py), or float32 /
bfloat16 on the CPU matmul kernel over pre-packed weights (packed_linear.py, kernels_pallas/cpu/gemm.py).

`cpu_matmul` ("auto" | "packed" | "xla"; the CBJAX_MATMUL environment variable overrides it): "auto" packs a
float32 or bfloat16 model served on the CPU backend without tensor parallelism when the kernel builds here and
kernels_pallas/cpu/auto.py's measured table takes it for this build (not a build without AVX-512; for bf16
linears, not one without AVX512-BF16), else keeps XLA's dot; "packed" insists (ValueError saying why it cannot,
RuntimeError if the kernel does not build); "xla" never packs. Decode-sized matmuls are where packing pays
(docs/benchmarks.md, "What each lever gave").
"""

import functools
import logging
import os

import jax
from flax import nnx

from cbjax.config.model import CPU_MATMULS
from cbjax.model.packed_linear import linear_dtypes, pack_model, unpackable_reason
from cbjax.model.quantize import quantize_model
from kernels_pallas.cpu import auto as cpu_auto
from kernels_pallas.cpu import gemm as cpu_gemm

ENV_VAR = "CBJAX_MATMUL"
_log = logging.getLogger("cbjax")


def resolve_cpu_matmul(impl: str, model, tensor_parallel_size: int = 1) -> str:
    """ "packed" or "xla" for this model (see the module docstring); the environment variable wins."""
    impl = os.environ.get(ENV_VAR) or impl
    if impl not in CPU_MATMULS:
        raise ValueError(f"cpu_matmul ({ENV_VAR}) must be one of {CPU_MATMULS}, got {impl!r}")
    if impl == "xla":
        return "xla"
    reason = unpackable_reason(model)
    if reason is None and jax.default_backend() != "cpu":
        reason = f"the backend is {jax.default_backend()}, not cpu"
    if reason is None and tensor_parallel_size > 1:
        reason = "tensor parallelism splits the weights (the packed panels have no sharding rule)"
    if reason is not None:
        if impl == "packed":
            raise ValueError(f"cpu_matmul='packed' is not possible here: {reason}")
        return "xla"
    if impl == "packed":
        if not cpu_gemm.available():
            raise RuntimeError(f"cpu_matmul='packed', but the kernel is unavailable: {cpu_gemm.unavailable_reason()}")
        return "packed"
    reason = cpu_auto.auto_reason("matmul")  # the kernel unavailable, or measured slower than XLA on this build
    if reason is None and "bfloat16" in linear_dtypes(model):
        reason = cpu_auto.auto_reason("matmul_bf16")  # its fast path needs AVX512-BF16
    if reason is not None:
        _warn_unavailable_once(reason)
        return "xla"
    return "packed"


@functools.cache
def _warn_unavailable_once(reason: str) -> None:
    _log.warning("cbjax: CPU matmul kernel not used, keeping XLA's dot: %s", reason)


def serving_model(model, quantization: str | None, cpu_matmul: str, tensor_parallel_size: int = 1):
    """The model with its linears as the engine serves them: int8 when `quantization`, else packed when
    resolve_cpu_matmul says so, else as given. Changed linears go on a new module over the same arrays, so a Llama
    the caller passed in stays as it was."""
    if quantization is not None:
        return quantize_model(nnx.merge(*nnx.split(model)), quantization)
    if resolve_cpu_matmul(cpu_matmul, model, tensor_parallel_size) == "packed":
        return pack_model(nnx.merge(*nnx.split(model)))
    return model
