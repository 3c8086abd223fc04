import os

# Tests run on the CPU whatever the machine has; set before anything imports jax.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import gc
import sys

import pytest


@pytest.fixture(scope="module", autouse=True)
def _release_compiled_programs():
    """After each test file: drop jax's in-memory caches of compiled programs (the file's engines went with its
    fixtures). Every compiled XLA:CPU program keeps code regions mapped; a worker that ran many files' programs
    passed Linux's default vm.max_map_count (65,530) and segfaulted while loading one more (seen 2026-12-05 in
    tests/structured/test_speculative_structured.py, near the end of a full run). Clearing roughly halves what a
    file leaves mapped (test_speculative_structured: ~10k maps without, ~5k with)."""
    yield
    jax = sys.modules.get("jax")  # (a file that never imported jax has nothing to release)
    if jax is not None:
        gc.collect()
        jax.clear_caches()
        gc.collect()
