"""One entry point for paged attention with a backend switch; the model's attention goes through it.

Backends: `xla` = the XLA path of xla_attention.py (the fast CPU default); `pallas` = the Pallas kernel of
ragged_paged_attention.py (compiled on TPU/GPU, or interpreted on CPU when `interpret=True`, for tests);
`auto` = pallas on TPU/GPU, xla elsewhere. The slow pure-jnp definitions the kernels are tested against are the
`reference_*` functions next to each kernel, not a backend.
"""

import jax

from kernels_pallas.choices import BACKENDS
from kernels_pallas.xla_attention import xla_ragged_paged_attention


def resolve_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "pallas" if jax.default_backend() in ("tpu", "gpu") else "xla"
    return backend


def ragged_attention(
    q,
    k_pages,
    v_pages,
    kv_lens,
    page_indices,
    cu_q_lens,
    num_seqs,
    *,
    sm_scale=None,
    sliding_window=None,
    soft_cap=None,
    backend: str = "auto",
    interpret: bool = False,
    mesh=None,
    k_scales=None,
    v_scales=None,
):
    """Attention of a flat mixed batch over the paged cache; see xla_attention.py for the contract. An int8 cache
    passes its scales [K, P, G, 1] as k_scales / v_scales (kernels_pallas/kv_quant.py).

    `mesh`: with a "model" axis that divides the kv heads, the heads are split over it and each device attends
    with its own (q heads n with kv head n // (N / K) stay together: both are split in contiguous blocks); every
    backend then runs per shard, unchanged."""
    if mesh is not None and mesh.shape.get("model", 1) > 1 and k_pages.shape[0] % mesh.shape["model"] == 0:
        from jax.sharding import PartitionSpec as P

        def per_shard(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, scales):
            return ragged_attention(
                q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
                sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap, backend=backend,
                interpret=interpret, **scales,
            )  # fmt: skip

        heads = P(None, "model", None)
        scales = {} if k_scales is None else dict(k_scales=k_scales, v_scales=v_scales)  # split like the pages
        return jax.shard_map(
            per_shard,
            mesh=mesh,
            in_specs=(heads, P("model"), P("model"), P(), P(), P(), P(), {k: P("model") for k in scales}),
            out_specs=heads,
            check_vma=False,
        )(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, scales)
    backend = resolve_backend(backend)
    kw = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap)
    if k_scales is not None or v_scales is not None:
        kw.update(k_scales=k_scales, v_scales=v_scales)
    if backend == "xla":
        return xla_ragged_paged_attention(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **kw)
    from kernels_pallas.ragged_paged_attention import ragged_paged_attention

    # The kernel takes q in the float pages' dtype. The model's activations are float32 whatever its weights (its
    # linears accumulate in f32), so with bfloat16 pages q is cast down for the kernel (bf16 attention, as vLLM's
    # kernels run it) and the output back up; the XLA path reads bf16 pages into f32 math instead.
    kernel_q = q if k_scales is not None or q.dtype == k_pages.dtype else q.astype(k_pages.dtype)
    out = ragged_paged_attention(
        kernel_q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, interpret=interpret, **kw
    )
    return out.astype(q.dtype)
