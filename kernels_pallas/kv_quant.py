"""int8 KV cache: the quantization every writer uses and the dequantization every attention path follows.

A quantized layer cache holds, next to the int8 pages k_pages / v_pages [K, P, G, H], one float32 scale per token
and kv head: k_scales / v_scales [K, P, G, 1]. Row (kv head k, page p, offset g) stands for
`k_pages[k, p, g].astype(float32) * k_scales[k, p, g, 0]`; `dequantize` is that definition, and every kernel must
equal attention over the dequantized pages (the kernel tests check exactly that).

Why per token (and not one scale per page and kv head): a page is filled a token at a time during decode, so a
per-page scale would be fixed by the page's first token (later, larger values clip) or need the page re-quantized
as it fills. A per-token scale is final when the token is written, costs 4 bytes per H int8 values (6% at H = 64),
and its error is the smallest of the two (measured in docs/memory.md). The trailing axis of size 1 keeps the
scales shaped like the pages, so whatever moves pages (swap, sharding by kv head, page gathers) moves the scales
with the same code, and a Pallas block of one page's scales is a [G, 1] tile.

Symmetric, absmax / 127 per row: values land in [-127, 127] (never -128, so negation is exact) and zero stays
exactly zero. An all-zero row gets scale 0, and dequantizes to zeros.
"""

import jax
import jax.numpy as jnp

QMAX = 127.0


def is_quantized(kv_cache_dtype) -> bool:
    return kv_cache_dtype == "int8"


def quantize(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [..., H] (any float) -> (int8 [..., H], float32 scales [..., 1]) with x ~= q * scale."""
    xf = x.astype(jnp.float32)
    scale = jnp.max(jnp.abs(xf), axis=-1, keepdims=True) / QMAX
    q = jnp.round(xf / jnp.where(scale > 0, scale, 1.0))
    return jnp.clip(q, -QMAX, QMAX).astype(jnp.int8), scale


def dequantize(pages: jax.Array, scales: jax.Array | None) -> jax.Array:
    """float32 values of int8 pages [..., H] and scales [..., 1]; float pages (scales None) just upcast."""
    if scales is None:
        return pages.astype(jnp.float32)
    return pages.astype(jnp.float32) * scales.astype(jnp.float32)


def round_trip(x: jax.Array) -> jax.Array:
    """What an int8 cache gives back for rows x [..., H]: dequantize(quantize(x)), in x's dtype."""
    return dequantize(*quantize(x)).astype(x.dtype)


def check_scales(k_pages, v_pages, k_scales, v_scales) -> None:
    """int8 pages need both scales, float32 [K, P, G, 1]; float pages take none (ValueError otherwise)."""
    if (k_scales is None) != (v_scales is None):
        raise ValueError("k_scales and v_scales must be given together (both or neither)")
    int8_pages = (k_pages.dtype == jnp.int8, v_pages.dtype == jnp.int8)
    if k_scales is None:
        if any(int8_pages):
            raise ValueError(
                f"int8 pages need k_scales and v_scales (float32 [K, P, G, 1]), got k_pages {k_pages.dtype}, "
                f"v_pages {v_pages.dtype} and no scales"
            )
        return
    if not all(int8_pages):
        raise ValueError(
            f"k_scales / v_scales are only for int8 pages, got k_pages {k_pages.dtype}, v_pages {v_pages.dtype}"
        )
    want = (*k_pages.shape[:3], 1)
    for name, scales in (("k_scales", k_scales), ("v_scales", v_scales)):
        if scales.dtype != jnp.float32:
            raise ValueError(f"{name} must be float32, got {scales.dtype}")
        if tuple(scales.shape) != want:
            raise ValueError(f"{name} must have shape [K, P, G, 1] = {want}, got {tuple(scales.shape)}")
