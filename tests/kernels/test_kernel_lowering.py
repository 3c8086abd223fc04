"""Each compiled (non-interpret) kernel lowers for its real platform, from CPU.

`jit(...).trace(...).lower(lowering_platforms=...)` runs the whole Pallas
lowering (Pallas -> Mosaic MLIR for TPU, Pallas -> Triton IR for GPU) and the
MLIR verifier without a device. What it cannot do from a CPU-only jaxlib is
the device-side compilation: Mosaic's layout passes (libtpu) and Triton's
PTX/ptxas pipeline (XLA's GPU backend) only run on a TPU / GPU host, so tile
shape limits those impose are not proven here (see docs/kernels.md).
"""

import functools

import jax
import jax.numpy as jnp
import pytest

from kernels_pallas.paged_attention import paged_attention
from kernels_pallas.ragged_paged_attention import ragged_paged_attention

_S = jax.ShapeDtypeStruct
# Small but production-shaped: G=16, H=128, GQA 4, bucketed token count.
K, P, G, H, GQA, SLOTS, PAGES_PER_SEQ, TOKENS = 2, 64, 16, 128, 4, 8, 8, 64

# Where each variant must end up, and the custom call that carries the kernel.
TARGETS = {"tpu": ("tpu", "tpu_custom_call"), "gpu": ("cuda", "__gpu$xla.gpu.triton")}
OPTIONS = {
    "plain": {},
    "window_softcap": dict(sliding_window=48, soft_cap=30.0),
}


def _decode_args(dtype, kv_dtype=None):
    kv = _S((K, P, G, H), kv_dtype or dtype)
    return (_S((SLOTS, K * GQA, H), dtype), kv, kv, _S((SLOTS,), jnp.int32), _S((SLOTS, PAGES_PER_SEQ), jnp.int32))


def _ragged_args(dtype, kv_dtype=None):
    kv = _S((K, P, G, H), kv_dtype or dtype)
    return (
        _S((TOKENS, K * GQA, H), dtype),
        kv,
        kv,
        _S((SLOTS,), jnp.int32),
        _S((SLOTS, PAGES_PER_SEQ), jnp.int32),
        _S((SLOTS + 1,), jnp.int32),
        _S((1,), jnp.int32),
    )


@pytest.mark.parametrize("options", OPTIONS, ids=str)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("variant", TARGETS)
@pytest.mark.parametrize(
    "op, make_args",
    [
        (paged_attention, _decode_args),
        (ragged_paged_attention, _ragged_args),
    ],
    ids=["decode", "ragged"],
)
def test_lowers_for_its_platform(op, make_args, variant, dtype, options):
    lowering_platform, custom_call = TARGETS[variant]
    fn = jax.jit(functools.partial(op, platform=variant, **OPTIONS[options]))
    text = fn.trace(*make_args(dtype)).lower(lowering_platforms=(lowering_platform,)).as_text()
    # Exactly one launch of the real kernel: no interpreter loop, no fallback.
    assert text.count(f"custom_call @{custom_call}(") == 1


@pytest.mark.parametrize("options", OPTIONS, ids=str)
@pytest.mark.parametrize("variant", TARGETS)
@pytest.mark.parametrize(
    "op, make_args",
    [
        (paged_attention, _decode_args),
        (ragged_paged_attention, _ragged_args),
    ],
    ids=["decode", "ragged"],
)
def test_int8_pages_lower_for_its_platform(op, make_args, variant, options):
    # int8 pages with their float32 [K, P, G, 1] scales (bf16 q): the dequantizing kernel is still one launch.
    lowering_platform, custom_call = TARGETS[variant]
    scales = _S((K, P, G, 1), jnp.float32)
    fn = jax.jit(lambda *args, ks, vs: op(*args, k_scales=ks, v_scales=vs, platform=variant, **OPTIONS[options]))
    traced = fn.trace(*make_args(jnp.bfloat16, jnp.int8), ks=scales, vs=scales)
    text = traced.lower(lowering_platforms=(lowering_platform,)).as_text()
    assert text.count(f"custom_call @{custom_call}(") == 1
    # The kernel takes the int8 pages and their scales as they are: no dequantized copy of the cache is made
    # outside it.
    (launch,) = [line for line in text.splitlines() if f"custom_call @{custom_call}(" in line]
    pages, scales = f"tensor<{K}x{P}x{G}x{H}xi8>", f"tensor<{K}x{P}x{G}x1xf32>"
    assert f"{pages}, {pages}, {scales}, {scales})" in launch


def _dot_precisions(jaxpr) -> list:
    """The precision of every dot_general in `jaxpr` and the jaxprs inside it (the kernel body of a pallas_call,
    loops, conds)."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            found.append((eqn.invars[0].aval.dtype, eqn.params["precision"]))
        for v in eqn.params.values():
            for sub in v if isinstance(v, (tuple, list)) else (v,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    found += _dot_precisions(inner)
    return found


@pytest.mark.parametrize("variant", TARGETS)
@pytest.mark.parametrize("op, make_args", [(paged_attention, _decode_args), (ragged_paged_attention, _ragged_args)],
                         ids=["decode", "ragged"])  # fmt: skip
def test_float32_kernels_ask_for_float32_dots(op, make_args, variant):
    # A dot's default precision is TF32 in Triton and one bf16 pass on TPU: on an H200 the float32 kernels missed
    # their float32 reference by up to 70x the tolerance until their dots asked for HIGHEST (docs/kernels.md).
    fn = functools.partial(op, platform=variant, **OPTIONS["window_softcap"])
    dots = _dot_precisions(jax.make_jaxpr(fn)(*make_args(jnp.float32)).jaxpr)
    assert dots and all(p is not None and p[0] == jax.lax.Precision.HIGHEST for dt, p in dots if dt == jnp.float32)
    assert any(dt == jnp.float32 for dt, _ in dots)
