"""cbjax: continuous batching of LLM inference in JAX.

Names are imported lazily, so `import cbjax.core` (the pure-Python scheduler) never pulls in jax.
"""

import importlib

_EXPORTS = {
    "LLM": "cbjax.llm",
    "LLMEngine": "cbjax.engine",
    "EngineConfig": "cbjax.engine_config",
    "SamplingParams": "cbjax.core.sampling_params",
    "RequestOutput": "cbjax.core.outputs",
    "CompletionOutput": "cbjax.core.outputs",
    "RequestMetrics": "cbjax.core.outputs",
    "StepDeltas": "cbjax.core.outputs",
    "StructuredOutputs": "cbjax.core.structured_outputs",
    "BeamSearchParams": "cbjax.beam_search",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'cbjax' has no attribute {name!r}")
