"""The int8 test caches carry the poison the kernel tests rely on.

int8 pages cannot hold NaN, so an int8 cache is only a NaN-safety test if its
unused rows have NaN scales; and the float64 truth must be what the int8 rows
stand for (kv_quant.dequantize), or the references would be checked against
values no kernel sees. Both are asserted here, so a change to the builder
cannot quietly turn the int8 kernel tests into tests that cannot fail.
"""

import jax.numpy as jnp
import numpy as np

from kernels_pallas import kv_quant
from tests.kernels.kv_cache_builder import build_paged_kv


def test_int8_cache_layout_truth_and_poison():
    page_size, kv_lens = 4, [0, 3, 4, 9]
    cache = build_paged_kv(
        np.random.default_rng(0),
        kv_lens,
        num_kv_heads=2,
        page_size=page_size,
        head_dim=16,
        pages_per_seq=3,
        dtype=None,
        quantize=True,
    )
    assert cache.k_pages.dtype == cache.v_pages.dtype == jnp.int8
    assert cache.k_scales.dtype == cache.v_scales.dtype == jnp.float32
    assert cache.k_scales.shape == cache.v_scales.shape == (*cache.k_pages.shape[:3], 1)

    used = np.zeros(cache.k_pages.shape[1:3], bool)  # [P, G]: rows that hold a live token
    for s, length in enumerate(kv_lens):
        for pos in range(length):
            page, row = int(cache.page_indices[s, pos // page_size]), pos % page_size
            used[page, row] = True
            for pages, scales, truth in (
                (cache.k_pages, cache.k_scales, cache.k_seqs[s]),
                (cache.v_pages, cache.v_scales, cache.v_seqs[s]),
            ):
                # The truth is exactly the dequantized row (what the kernels and references compute from).
                row_values = kv_quant.dequantize(pages[:, page, row], scales[:, page, row])
                np.testing.assert_array_equal(np.asarray(row_values, np.float64), truth[pos])
    for scales in (cache.k_scales, cache.v_scales):
        scales = np.asarray(scales)[..., 0]  # [K, P, G]
        assert np.isfinite(scales[:, used]).all()
        assert np.isnan(scales[:, ~used]).all(), "every unused row (spare pages, page tails) has a NaN scale"
    unused_page, tail = (~used).all(axis=1), (~used).any(axis=1) & used.any(axis=1)
    assert unused_page.any() and tail.any(), "both whole unused pages and page tails are poisoned"
    # Garbage, not zeros, in the unused int8 rows: a kernel that skips the scale would still see junk.
    assert np.abs(np.asarray(cache.k_pages)[:, ~used]).max() > 0
