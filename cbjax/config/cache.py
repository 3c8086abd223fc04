"""CacheConfig: the paged KV cache on the device, the host pool that swap preemption moves pages to, and what may
share or drop pages (prefix caching and its host tier, sliding-window eviction)."""

import dataclasses

from cbjax.config import validation as check
from cbjax.config.section import Section
from kernels_pallas.choices import KV_CACHE_DTYPES


@dataclasses.dataclass(frozen=True)
class CacheConfig(Section):
    page_size: int = 16  # tokens per KV page
    num_pages: int | None = None  # KV pages on the device; None: as many as kv_cache_memory_gib holds
    kv_cache_memory_gib: float = 1.0  # memory budget of the KV cache when num_pages is None
    # The KV pages' dtype: "auto" (the model's dtype), "float32", "bfloat16", or "int8" (a float32 scale per token
    # and kv head, dequantized inside attention: kernels_pallas/kv_quant.py). kv_cache_memory_gib then holds more pages.
    kv_cache_dtype: str = "auto"
    swap_space_gib: float = 1.0  # swap preemption: host memory for swapped-out KV pages
    num_host_pages: int | None = None  # swap preemption: host pool in pages; None: as many as swap_space_gib holds
    enable_prefix_caching: bool = False  # share the KV pages of identical prompt prefixes (vLLM's option)
    # With prefix caching: host memory for a second tier of the prefix cache (core/host_prefix_cache.py). A cached
    # page the device evicts is copied there and copied back on a later hit, instead of being recomputed. 0: off.
    host_cache_gib: float = 0.0
    num_host_cache_pages: int | None = None  # that tier in pages; None: as many as host_cache_gib holds
    # Sliding-window models (Mistral's sliding_window): free the KV pages no query can read any more, so a long
    # sequence holds about window / page_size + 1 pages. False keeps every page (to measure what eviction saves).
    evict_outside_window: bool = True

    def checked(self) -> dict:
        out = dict(
            page_size=check.integer("page_size", self.page_size, 1),
            num_pages=check.optional_integer("num_pages", self.num_pages, 1),
            kv_cache_memory_gib=check.real("kv_cache_memory_gib", self.kv_cache_memory_gib, 0.0, low_open=True),
            kv_cache_dtype=check.choice("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES),
            swap_space_gib=check.real("swap_space_gib", self.swap_space_gib, 0.0),
            num_host_pages=check.optional_integer("num_host_pages", self.num_host_pages, 0),
            enable_prefix_caching=check.boolean("enable_prefix_caching", self.enable_prefix_caching),
            host_cache_gib=check.real("host_cache_gib", self.host_cache_gib, 0.0),
            num_host_cache_pages=check.optional_integer("num_host_cache_pages", self.num_host_cache_pages, 0),
            evict_outside_window=check.boolean("evict_outside_window", self.evict_outside_window),
        )
        if not out["enable_prefix_caching"] and (out["host_cache_gib"] > 0 or out["num_host_cache_pages"]):
            raise ValueError(
                "host_cache_gib / num_host_cache_pages size the prefix cache's host tier: "
                "set enable_prefix_caching=True"
            )
        return out

    @property
    def num_host_kv_pages(self) -> int:
        """Host KV pages the runner allocates (resolved sizes): the swap pool's, then the prefix cache's host tier's
        (host page ids num_host_pages.. belong to the tier: one host array serves both, each with its own budget)."""
        return (self.num_host_pages or 0) + (self.num_host_cache_pages or 0)
