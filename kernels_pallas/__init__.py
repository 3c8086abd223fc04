"""Paged-attention kernels (Pallas, for TPU and GPU) next to their pure-jnp references, and an XLA path for CPU."""

from kernels_pallas.dispatch import BACKENDS, ragged_attention, resolve_backend

__all__ = ["BACKENDS", "ragged_attention", "resolve_backend"]
