"""Paged-attention kernels (Pallas, for TPU and GPU) next to their pure-jnp references, an XLA path for CPU, and
the CPU kernels in C++ (cpu/).

Names are imported lazily, so `import kernels_pallas.choices` (the options' allowed values) never pulls in jax.
"""

import importlib

_EXPORTS = {
    "BACKENDS": "kernels_pallas.choices",
    "ragged_attention": "kernels_pallas.dispatch",
    "resolve_backend": "kernels_pallas.dispatch",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'kernels_pallas' has no attribute {name!r}")
