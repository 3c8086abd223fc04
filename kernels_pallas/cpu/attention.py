"""Paged attention for CPU: the C++ XLA FFI handler of attention_ffi.cc (decode_attention.cc, prefill_attention.cc)
called from jax.

XLA:CPU lowers the loops of xla_attention.py to page-block gathers and tiny batched dots (~2-3 GB/s of K/V for
decode; prefill blocks rebuild masks and gathers per block); the C++ handler walks the page table and does q . K
and p . V in registers. `cpu_ragged_attention` fills the rows of decode sequences (q_len 1, decode_attention.cc),
of prefill sequences (q_len > 1, prefill_attention.cc), or both, and leaves every other row zero (for the XLA path
to fill, when it does the other kind). `cpu_decode_attention` is its decode-only form.

bf16 dot products: over bfloat16 pages the decode rows can run on AVX512-BF16's vdpbf16ps, with q and the softmax
weights rounded to bf16 (the rounding a bf16 model's matmul inputs get; products exact, sums in float32). That
changes results, so it is a choice the caller makes (`bf16_dots`, default from `$CBJAX_ATTENTION_BF16_DOTS`, "on" or
"off", off unless set); the handler takes it where it applies (bf16 pages, a head dim that is a multiple of 32, a
build with AVX512-BF16) and runs the float32-math kernel otherwise. float32 and int8 pages never see it.

The handler lives in the CPU kernels' shared library (library.py builds, caches and registers it on first use);
`available()` is False without a C++ compiler or when the build fails, and callers take the XLA path then.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas import kv_quant
from kernels_pallas.cpu import library

BF16_DOTS_ENV_VAR = "CBJAX_ATTENTION_BF16_DOTS"
ROWS = {"decode": 1, "prefill": 2, "both": 3}  # which sequences' rows a call fills (the handler's `rows`)


def available() -> bool:
    """True if the kernel is built (building it now if needed) and registered in this process."""
    return library.attention_target() is not None


def unavailable_reason() -> str | None:
    """Why `available()` is False (None if it is True or was not asked yet)."""
    return library.unavailable_reason()


def cpu_ragged_attention(
    q,
    k_pages,
    v_pages,
    kv_lens,
    page_indices,
    cu_q_lens,
    num_seqs,
    *,
    rows: str = "both",
    sm_scale: float | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    num_threads: int | None = None,
    k_scales=None,
    v_scales=None,
    bf16_dots: bool | None = None,
):
    """Ragged paged attention over the cache: [T, N, H] in q's dtype. `rows` picks the sequences whose rows are
    filled (all heads): "decode" (q_len 1), "prefill" (q_len > 1) or "both"; every other row is zero. Shapes and
    masking rules: docs/kernels.md. q float32 or bfloat16; k_pages and v_pages one of those too (may differ from
    q's: a float32 model with a bfloat16 cache), or int8 with their float32 scales k_scales / v_scales
    [K, P, G, 1] (kernels_pallas/kv_quant.py). `num_threads` (default: this process's CPUs) caps the threads the
    kernel uses (1: the calling thread only). `bf16_dots`: see the module docstring (None: the environment's
    choice). Jittable; runs on the CPU backend only. Raises RuntimeError if the
    kernel is unavailable (see `available`)."""
    target = library.attention_target()
    if target is None:
        raise RuntimeError(f"the CPU attention kernel is unavailable: {unavailable_reason()}")
    if rows not in ROWS:
        raise ValueError(f"rows must be one of {tuple(ROWS)}, got {rows!r}")
    q, k_pages, v_pages = (jnp.asarray(x) for x in (q, k_pages, v_pages))
    if q.ndim != 3 or k_pages.ndim != 4 or v_pages.shape != k_pages.shape:
        raise ValueError(
            f"expected q [T, N, H], k/v pages [K, P, G, H]; got {q.shape}, {k_pages.shape}, {v_pages.shape}"
        )
    floats = (jnp.float32, jnp.bfloat16)
    if k_pages.dtype != v_pages.dtype or q.dtype not in floats or k_pages.dtype not in (*floats, jnp.int8):
        raise ValueError(
            "q must be float32 or bfloat16 and k_pages = v_pages that or int8, got "
            f"{q.dtype}, {k_pages.dtype}, {v_pages.dtype}"
        )
    kv_quant.check_scales(k_pages, v_pages, k_scales, v_scales)
    if k_scales is None:  # the handler takes scale buffers always; float pages ignore them
        k_scales = v_scales = jnp.zeros((1,), jnp.float32)
    T, N, H = q.shape
    K = k_pages.shape[0]
    if k_pages.shape[3] != H or N % K:
        raise ValueError(f"head dims differ or N={N} is not a multiple of K={K}")
    i32 = lambda x: jnp.asarray(x, jnp.int32)
    if sliding_window is not None and sliding_window <= 0:
        raise ValueError(f"sliding_window must be positive, got {sliding_window}")
    if soft_cap is not None and soft_cap <= 0:
        raise ValueError(f"soft_cap must be positive, got {soft_cap}")
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((T, N, H), q.dtype))
    return call(
        q,
        k_pages,
        v_pages,
        i32(kv_lens),
        i32(page_indices),
        i32(cu_q_lens),
        i32(num_seqs).reshape(-1)[:1],
        k_scales,
        v_scales,
        sm_scale=np.float32(H**-0.5 if sm_scale is None else sm_scale),
        soft_cap=np.float32(0.0 if soft_cap is None else soft_cap),
        sliding_window=np.int32(0 if sliding_window is None else sliding_window),
        num_threads=np.int32(library.default_num_threads() if num_threads is None else num_threads),
        rows=np.int32(ROWS[rows]),
        bf16_dots=np.int32(resolve_bf16_dots() if bf16_dots is None else bool(bf16_dots)),
    )


def resolve_bf16_dots() -> bool:
    """Whether `$CBJAX_ATTENTION_BF16_DOTS` allows bf16 dot products over bf16 pages ("on"; "off" or unset: no)."""
    value = os.environ.get(BF16_DOTS_ENV_VAR, "off")
    if value not in ("on", "off"):
        raise ValueError(f"{BF16_DOTS_ENV_VAR} must be 'on' or 'off', got {value!r}")
    return value == "on"


def cpu_decode_attention(*args, **kwargs):
    """`cpu_ragged_attention` with rows="decode": the decode sequences' rows filled, zeros elsewhere."""
    return cpu_ragged_attention(*args, rows="decode", **kwargs)
