"""Writing a step's new K/V rows into the paged cache: XLA's scatter, or on CPU for bfloat16 pages the C++ handler
of cpu/kv_write.cc, in place.

XLA:CPU has no bfloat16 scatter: its float normalization makes a scatter into bf16 pages "convert the whole
layer's pages to f32, scatter, convert back", two passes over the cache for a few rows. With a bf16 cache that
made a llama-small decode step about 10x slower than with a float32 cache (docs/kernels.md, "KV writes"). The
handler writes the rows in place (the pages aliased to its output, the cache donated by the step programs).

`impl` (or the environment variable CBJAX_KV_WRITE, which wins): "xla", "ffi", or "auto" (the default): the
handler for bfloat16 pages on the CPU backend, unsharded, when the library is available; XLA's scatter otherwise
(float32 and int8 pages scatter at the cost of the rows written, and stay on it).
"""

import os

import jax
import jax.numpy as jnp

from kernels_pallas.cpu import library

IMPLS = ("auto", "ffi", "xla")
ENV_VAR = "CBJAX_KV_WRITE"


def resolve_kv_write(pages_dtype, *, impl: str = "auto", sharded: bool = False) -> str:
    """ "ffi" or "xla": how rows are written into pages of `pages_dtype` (see the module docstring). `sharded`: the
    pages are split over a mesh (the handler has no sharding rule, so those stay on XLA's scatter under auto)."""
    impl = os.environ.get(ENV_VAR) or impl
    if impl not in IMPLS:
        raise ValueError(f"kv write ({ENV_VAR}) must be one of {IMPLS}, got {impl!r}")
    if impl == "ffi":
        if library.kv_write_target() is None:
            raise RuntimeError(f"kv write 'ffi', but the CPU kernels are unavailable: {library.unavailable_reason()}")
        return "ffi"
    if impl == "xla" or sharded or jnp.dtype(pages_dtype) != jnp.bfloat16 or jax.default_backend() != "cpu":
        return "xla"
    return "ffi" if library.kv_write_target() is not None else "xla"


def write_rows(pages, rows, slot_mapping, *, impl: str = "auto", sharded: bool = False):
    """pages [K, P, G, X] with rows [T, K, X] written at flat rows slot_mapping [T] (page * G + offset), converted
    to the pages' dtype; returns the new pages. Jittable; donate the pages for an in-place write."""
    Kh, P, G, X = pages.shape
    if rows.ndim != 3 or rows.shape[1:] != (Kh, X) or slot_mapping.shape != rows.shape[:1]:
        raise ValueError(f"expected rows [T, {Kh}, {X}] and slot_mapping [T], got {rows.shape}, {slot_mapping.shape}")
    if resolve_kv_write(pages.dtype, impl=impl, sharded=sharded) == "ffi":
        call = jax.ffi.ffi_call(
            library.kv_write_target(), jax.ShapeDtypeStruct(pages.shape, pages.dtype), input_output_aliases={0: 0}
        )
        rows = rows if rows.dtype in (jnp.float32, jnp.bfloat16, pages.dtype) else rows.astype(pages.dtype)
        return call(pages, rows, jnp.asarray(slot_mapping, jnp.int32))
    rows = rows.transpose(1, 0, 2).astype(pages.dtype)  # [K, T, X]
    if X == 1:
        # An int8 cache's scales: XLA:CPU scatters [K, T, 1] slices into [K, P*G, 1] ~5x slower than single
        # elements into the flat array (0.30 vs 0.07 ms a layer for 64 rows of llama-tiny's pool, measured).
        idx = (jnp.arange(Kh, dtype=slot_mapping.dtype)[:, None] * (P * G) + slot_mapping[None, :]).reshape(-1)
        return pages.reshape(-1).at[idx].set(rows.reshape(-1)).reshape(Kh, P, G, X)
    return pages.reshape(Kh, P * G, X).at[:, slot_mapping].set(rows).reshape(Kh, P, G, X)


def write_pages(pages, blocks, page_idx, *, impl: str = "auto", sharded: bool = False):
    """pages [K, P, G, X] with whole pages blocks [K, n, G, X] written at pages page_idx [n]: a page copy or a
    swap-in, as `write_rows` over their rows, so that bfloat16 pages on the CPU are written in place too instead of
    converting the whole cache (runner/page_copy.py, runner/kv_swap.py). Jittable; donate the pages."""
    Kh, _, G, X = pages.shape
    n = blocks.shape[1]
    slots = (jnp.asarray(page_idx, jnp.int32)[:, None] * G + jnp.arange(G, dtype=jnp.int32)[None, :]).reshape(-1)
    rows = blocks.transpose(1, 2, 0, 3).reshape(n * G, Kh, X)
    return write_rows(pages, rows, slots, impl=impl, sharded=sharded)


def take_pages(pages, page_idx):
    """pages[:, page_idx] ([K, n, G, X]); bfloat16 pages are gathered through a uint16 view, because XLA:CPU converts
    the whole operand of a bf16 gather to float32 (and the bits are all a copy needs)."""
    if pages.dtype != jnp.bfloat16:
        return pages[:, page_idx]
    bits = jax.lax.bitcast_convert_type(pages, jnp.uint16)[:, page_idx]
    return jax.lax.bitcast_convert_type(bits, jnp.bfloat16)


def is_sharded(pages) -> bool:
    """Whether a (concrete) pages array is split over several devices: the handler has no sharding rule."""
    sharding = getattr(pages, "sharding", None)
    return sharding is not None and len(sharding.device_set) > 1
