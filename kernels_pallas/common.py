"""Shared pieces of the two paged-attention kernels.

Both ops (decode `paged_attention` and `ragged_paged_attention`) read the same
paged KV layout and run the same online-softmax update; keeping that update in
one place means the four kernels (TPU and GPU variant of each op) cannot drift
apart in how they mask, cap or rescale.

Glossary: R query rows in a tile, C kv tokens in a tile, H head dim, K kv heads,
P pages, G page size, N query heads.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from kernels_pallas import kv_quant

# Programs we want in flight on a GPU before splitting the kv context stops
# paying off (about two waves on an H100/H200's 132 SMs), and a cap on the
# splits (each adds an f32 partial output the wrapper has to merge).
GPU_TARGET_PROGRAMS = 256
GPU_MAX_SPLITS = 16

# Platforms accepted by the `platform=` argument of the public wrappers, mapped
# to the kernel variant that serves them.
_VARIANTS = {"tpu": "tpu", "gpu": "gpu", "cuda": "gpu", "rocm": "gpu"}


def next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def is_pow2(x: int) -> bool:
    return x > 0 and (x & (x - 1)) == 0


def resolve_variant(platform: str | None, interpret: bool) -> str:
    """Returns "tpu" (Mosaic kernel) or "gpu" (Triton kernel).

    None means "the backend jax runs on". On CPU there is no compiled Pallas
    kernel at all, so None only makes sense together with interpret=True; the
    TPU variant is then chosen because it is the one the production engine
    targets.
    """
    if platform is None:
        platform = jax.default_backend()
        if platform == "cpu":
            if not interpret:
                raise ValueError(
                    "Pallas kernels do not run compiled on CPU: pass interpret=True "
                    "(tests) or use the reference_* function / XLA path instead."
                )
            return "tpu"
    variant = _VARIANTS.get(platform)
    if variant is None:
        raise ValueError(f"platform must be one of {sorted(_VARIANTS)} or None, got {platform!r}")
    return variant


def check_kv_pages(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, k_scales=None, v_scales=None) -> None:
    """Validates q [*, N, H] against k_pages / v_pages [K, P, G, H] and, for int8 pages, their scales.

    Float pages must share q's dtype; int8 pages (kernels_pallas/kv_quant.py) go with any float q, and then only
    with both scales.
    """
    if k_pages.ndim != 4:
        raise ValueError(f"k_pages must be [K, P, G, H] (4-D), got shape {k_pages.shape}")
    if v_pages.shape != k_pages.shape:
        raise ValueError(f"v_pages shape {v_pages.shape} != k_pages shape {k_pages.shape}")
    check_kv_scales(k_pages, v_pages, k_scales, v_scales)
    if k_scales is None and not (q.dtype == k_pages.dtype == v_pages.dtype):
        raise ValueError(
            f"q, k_pages and v_pages must share one dtype, got {q.dtype}, {k_pages.dtype}, {v_pages.dtype}"
        )
    if not jnp.issubdtype(q.dtype, jnp.floating):
        raise ValueError(f"q must be a floating dtype, got {q.dtype}")
    num_kv_heads, _, _, head_dim = k_pages.shape
    num_heads, q_head_dim = q.shape[-2:]
    if q_head_dim != head_dim:
        raise ValueError(f"q head dim {q_head_dim} != k_pages head dim {head_dim}")
    if num_heads % num_kv_heads:
        raise ValueError(f"query heads N={num_heads} must be a multiple of kv heads K={num_kv_heads} (GQA)")


def check_kv_scales(k_pages: jax.Array, v_pages: jax.Array, k_scales, v_scales) -> None:
    """kv_quant.check_scales (one definition for every attention path). The references call it too: without it,
    int8 pages passed without scales would silently be attended as raw integers."""
    kv_quant.check_scales(k_pages, v_pages, k_scales, v_scales)


def dequantize_tile(x: jax.Array, scales: jax.Array | None, dtype) -> jax.Array:
    """A kv tile [C, H] as the attention math reads it; int8 tiles get their scales [C, 1].

    Float tiles (scales None) pass unchanged. int8 tiles are dequantized in f32 by the kv_quant definition, then
    cast to q's dtype: the matmuls then run in the same dtype as with float pages of q's dtype (bf16 on the
    MXU / tensor cores for bf16 q, exact f32 for f32 q) and never see mixed operand dtypes. NaN scales of unused
    rows make NaN rows here; attend_tile masks them afterwards exactly as it masks NaN float pages.
    """
    if scales is None:
        return x
    return kv_quant.dequantize(x, scales).astype(dtype)


def load_kv_tile(ref, scales_ref, index, dtype) -> jax.Array:
    """ref[index] through dequantize_tile, with scales_ref[index] when the cache is int8 (scales_ref not None)."""
    return dequantize_tile(ref[index], None if scales_ref is None else scales_ref[index], dtype)


def with_scale_refs(kernel, num_refs_before: int, quantized: bool):
    """The kernel for a pallas_call, whose refs arrive positionally.

    Kernels are written with `k_scales_ref, v_scales_ref` right after their page refs; a float cache passes no
    scale arrays (so its pallas_call, and its generated code, is unchanged), and this inserts None for them.
    """
    if quantized:
        return kernel

    def float_kernel(*refs):
        return kernel(*refs[:num_refs_before], None, None, *refs[num_refs_before:])

    return float_kernel


def check_int32(name: str, x: jax.Array, shape: tuple[int, ...]) -> None:
    if x.dtype != jnp.int32:
        raise ValueError(f"{name} must be int32, got {x.dtype}")
    if x.shape != shape:
        raise ValueError(f"{name} must have shape {shape}, got {x.shape}")


def check_options(sm_scale, soft_cap, sliding_window) -> None:
    if sm_scale is not None and not sm_scale > 0:
        raise ValueError(f"sm_scale must be > 0, got {sm_scale}")
    if soft_cap is not None and not soft_cap > 0:
        raise ValueError(f"soft_cap must be > 0, got {soft_cap}")
    if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 1):
        raise ValueError(f"sliding_window must be a positive int, got {sliding_window!r}")


def check_gpu_shapes(page_size: int, head_dim: int) -> None:
    # Triton tensors must have power-of-two sizes and tl.dot needs every
    # dimension >= 16; the kernel pads query rows and kv tiles, but G and H come
    # straight from the cache layout.
    if not is_pow2(page_size):
        raise ValueError(f"GPU kernel needs a power-of-two page size, got G={page_size}")
    if not is_pow2(head_dim) or head_dim < 16:
        raise ValueError(f"GPU kernel needs a power-of-two head dim >= 16, got H={head_dim}")


def sanitize_page_indices(page_indices: jax.Array, num_pages: int) -> jax.Array:
    # Entries past a sequence's used pages are "don't care" for the engine and
    # may hold anything (-1, stale ids). Kernels may still fetch them (a clamped
    # BlockSpec index, the tail of a multi-page tile); clipping turns that into a
    # harmless in-bounds read whose tokens are masked, instead of an OOB DMA.
    return jnp.clip(page_indices, 0, num_pages - 1)


def group_heads(q: jax.Array, num_kv_heads: int, rows_per_kv_head: int) -> jax.Array:
    """[..., N, H] -> [..., K, r_pad, H]; query head n goes to kv head n // r.

    Rows r..r_pad-1 are zeros: they give finite scores and are sliced away.
    """
    *lead, num_heads, head_dim = q.shape
    r = num_heads // num_kv_heads
    q = q.reshape(*lead, num_kv_heads, r, head_dim)
    if rows_per_kv_head > r:
        pad = [(0, 0)] * len(lead) + [(0, 0), (0, rows_per_kv_head - r), (0, 0)]
        q = jnp.pad(q, pad)
    return q


def ungroup_heads(o: jax.Array, num_heads: int) -> jax.Array:
    """[..., K, r_pad, H] -> [..., N, H], dropping the padding rows."""
    *lead, num_kv_heads, _, head_dim = o.shape
    r = num_heads // num_kv_heads
    return o[..., :r, :].reshape(*lead, num_heads, head_dim)


def attend_tile(q, k, v, score_mask, kv_valid, m, l, acc, *, sm_scale, soft_cap):
    """One online-softmax step of a query tile against one kv tile.

    q: [R, H] (input dtype); k, v: [C, H]; score_mask: bool [R, C], True where
    the row may attend to the token; kv_valid: bool [C, 1], True where the kv
    row holds a real token (< kv_len). m, l: f32 [R, 1] running max / sum;
    acc: f32 [R, H] unnormalised output.

    Masking uses `where`, never multiplication: unused pages may hold NaN and
    0 * NaN = NaN. V rows outside the context are zeroed for the same reason
    (their softmax weight is 0, but 0 * NaN would still poison the PV matmul).
    The running max starts at -inf; while a row has seen nothing it stays -inf
    and `m_safe` = 0 keeps exp() from evaluating -inf - -inf.
    """
    # float32 inputs get float32 products: a dot's default precision is TF32 on GPU (Triton) and one bf16 pass on
    # TPU, which missed the f32 reference by up to 70x the tolerance on an H200 (docs/kernels.md).
    precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=jnp.float32)
    s = s * sm_scale
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    s = jnp.where(score_mask, s, -jnp.inf)
    v = jnp.where(kv_valid, v, jnp.zeros_like(v))

    m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))  # [R, 1]
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp(m - m_safe)  # [R, 1]; 0 when m is still -inf
    p = jnp.exp(s - m_safe)  # [R, C]; exactly 0 where masked
    l_new = alpha * l + jnp.sum(p, axis=1, keepdims=True)
    pv_precision = lax.Precision.HIGHEST if v.dtype == jnp.float32 else None
    pv = lax.dot_general(
        p.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=pv_precision, preferred_element_type=jnp.float32
    )  # [R, H]
    acc_new = alpha * acc + pv
    return m_new, l_new, acc_new


def finalize(acc, l, dtype):
    """acc / l, with rows that saw no token (l == 0) set to 0 instead of NaN."""
    safe_l = jnp.where(l > 0, l, 1.0)
    return jnp.where(l > 0, acc / safe_l, 0.0).astype(dtype)


def default_gpu_splits(num_programs: int, max_tiles: int) -> int:
    """kv splits per program so that about GPU_TARGET_PROGRAMS run at once."""
    splits = next_pow2(-(-GPU_TARGET_PROGRAMS // num_programs))
    return max(1, min(splits, GPU_MAX_SPLITS, max_tiles))


def split_range(lo, hi, split, num_splits):
    """This split's even share [start, stop) of the tile range [lo, hi)."""
    per_split = lax.div(jnp.maximum(hi - lo, 0) + num_splits - 1, num_splits)
    start = lo + split * per_split
    return start, jnp.minimum(start + per_split, hi)


def merge_partials(acc, m, l, dtype):
    """Merges split softmaxes: acc [splits, ..., H], m and l [splits, ..., 1].

    Each split's sums are rescaled to the common max (log-sum-exp); splits that
    saw no token have m = -inf and l = 0 and drop out.
    """
    m_all = jnp.max(m, axis=0)
    scale = jnp.exp(m - jnp.where(m_all == -jnp.inf, 0.0, m_all))
    return finalize(jnp.sum(scale * acc, axis=0), jnp.sum(scale * l, axis=0), dtype)
