"""The values the kernels' options accept, in one place and free of jax, so that a config can be checked (e.g. by
cbjax.engine_config) without importing jax or the kernels.

BACKENDS: the attention backend of `kernels_pallas.ragged_attention` (dispatch.py). KV_CACHE_DTYPES: the dtype of
the KV cache pages, "int8" with a float32 scale per token and kv head (kv_quant.py); "auto" is the model's dtype.
"""

BACKENDS = ("auto", "pallas", "xla")
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "int8")
