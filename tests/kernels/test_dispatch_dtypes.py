"""The dispatch's dtype contract: the model's activations are float32 whatever its weights, so with bfloat16 KV
pages q reaches `ragged_attention` as float32. The XLA path reads the pages into f32 math; the Pallas kernels take
q in the pages' dtype, so the dispatch casts it down and the output back (an H200 run of the engine in bf16 raised
"q, k_pages and v_pages must share one dtype" before it did)."""

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.dispatch import ragged_attention


def test_float32_queries_over_bfloat16_pages_run_on_the_kernel_and_match_the_xla_path():
    rng = np.random.default_rng(0)
    K, N, H, G, P = 1, 2, 32, 16, 8
    k_pages, v_pages = (jnp.asarray(rng.standard_normal((K, P, G, H)), jnp.bfloat16) for _ in range(2))
    kv_lens = jnp.asarray([5, 20], jnp.int32)  # a 5-token prefill and a decode at context 20
    page_indices = jnp.asarray([[0, 1, 2, 3], [4, 5, 6, 7]], jnp.int32)
    cu_q_lens = jnp.asarray([0, 5, 6], jnp.int32)
    q = jnp.asarray(rng.standard_normal((8, N, H)), jnp.float32)  # 6 tokens and 2 padding rows
    args = (q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, jnp.asarray([2], jnp.int32))
    want = ragged_attention(*args, backend="xla")
    got = ragged_attention(*args, backend="pallas", interpret=True)
    assert got.dtype == want.dtype == jnp.float32
    # bf16 attention against f32 math over the same bf16 pages: bf16's rounding of q and of the probabilities.
    np.testing.assert_allclose(np.asarray(got[:6]), np.asarray(want[:6]), atol=3e-2, rtol=3e-2)
    assert jax.numpy.isfinite(got[:6]).all()
