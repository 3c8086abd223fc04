"""Rotary position embeddings (the 'rotate half' convention of Hugging Face Llama), with rope scaling."""

import math

import jax.numpy as jnp
import numpy as np


def inv_frequencies(head_dim: int, theta: float, scaling: tuple | None) -> np.ndarray:
    """Per-pair inverse frequencies [H/2], with `linear` or `llama3` scaling applied (computed once, host-side)."""
    inv = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    if not scaling:
        return inv.astype(np.float32)
    s = dict(scaling)
    kind = s.get("rope_type", s.get("type", "default"))
    if kind == "default":
        pass
    elif kind == "linear":
        inv = inv / float(s["factor"])
    elif kind == "llama3":
        factor = float(s["factor"])
        low, high = float(s.get("low_freq_factor", 1.0)), float(s.get("high_freq_factor", 4.0))
        old_len = float(s.get("original_max_position_embeddings", 8192))
        wavelen = 2 * math.pi / inv
        low_wavelen, high_wavelen = old_len / low, old_len / high
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
        mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
        inv = np.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
    else:
        raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: default, linear, llama3)")
    return inv.astype(np.float32)


def apply_rope(x: jnp.ndarray, positions: jnp.ndarray, inv_freq: np.ndarray) -> jnp.ndarray:
    """x [..., T, heads, H] rotated by positions [..., T]."""
    angles = positions[..., None].astype(jnp.float32) * jnp.asarray(inv_freq)  # [..., T, H/2]
    cos = jnp.cos(angles)[..., None, :]
    sin = jnp.sin(angles)[..., None, :]
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    x1, x2 = xf[..., :half], xf[..., half:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)
