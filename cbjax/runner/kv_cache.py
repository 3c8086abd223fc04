"""The paged KV cache on the device: allocated once, then passed into and out of every step program (donated).

Per layer (k_pages, v_pages), each [K, P+1, G, H], and for int8 pages their scales [K, P+1, G, 1] too
(kernels_pallas/kv_quant.py). The extra page (index P, `pad_page`) takes the writes of padding tokens, so they
never touch a live page.
"""

import jax.numpy as jnp
from jax.sharding import NamedSharding

from cbjax.model.config import ModelConfig
from cbjax.model.llama import kv_cache_arrays
from cbjax.runner import sharding
from cbjax.runner.placement import Placement


def allocate_kv_cache(
    cfg: ModelConfig, *, num_pages: int, page_size: int, kv_cache_dtype: str, placement: Placement
) -> list[tuple]:
    """Zeroed KV pages for `cfg`: `num_pages` live pages and the spare one, each of `page_size` tokens, as
    `kv_cache_dtype` says ("auto": the model's dtype). On a mesh they are split by kv heads (sharding.kv_spec) and
    made on the devices; otherwise placed as `placement` puts things."""
    arrays = kv_cache_arrays(cfg, num_pages + 1, page_size, kv_cache_dtype)
    mesh = placement.mesh
    if mesh is not None:
        kv_sharding = NamedSharding(mesh, sharding.kv_spec(cfg.num_kv_heads, mesh))
        zeros = lambda shape, dt: sharding.zeros_global(shape, dt, kv_sharding)
    else:
        zeros = lambda shape, dt: placement.put(jnp.zeros(shape, dt))
    return [tuple(zeros(*a) for a in arrays) for _ in range(cfg.num_layers)]


def num_device_pages(kv_caches: list[tuple]) -> int:
    """The live pages of a cache `allocate_kv_cache` made (its spare page not counted)."""
    return kv_caches[0][0].shape[1] - 1
