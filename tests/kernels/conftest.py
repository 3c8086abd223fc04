"""Fixtures for the CPU kernels' tests: the library's builds to run them against.

`cpu_build` runs a test once per build: "native" (what -march=native gives this machine: the AVX-512 paths here)
and "portable" (`$CBJAX_CPU_BUILD` = PORTABLE_OPTIONS: the loops a CPU without AVX-512 runs, compiled with the
checked build's metadata checks too, so that the suite pays for one extra build, not two). `portable_build` is the
latter alone. The portable library is built once per machine into its own cache entry (kernels_pallas/cpu/
library.py) and registered once per process; a test under it traces its own jitted functions, so every call it
makes names the portable build's FFI target (test_cpu_build.py checks that).
"""

import pytest

from kernels_pallas.cpu import library

PORTABLE_OPTIONS = "checked,no-avx512"


@pytest.fixture
def portable_build(monkeypatch):
    """The portable + checked build of the library, loaded for the duration of the test."""
    monkeypatch.setenv(library.BUILD_ENV_VAR, PORTABLE_OPTIONS)
    if library.unbuildable_reason() is not None:  # no compiler (the native tests skip too), or not x86-64
        pytest.skip(f"no portable build here: {library.unbuildable_reason()}")
    with library.fresh_state():
        if library.attention_target() is None:  # the native build works here, so this one must too
            pytest.fail(f"the portable build failed: {library.unavailable_reason()}")
        features = library.features()
        assert not features["avx512f"] and features["checked"], features
        yield "portable"


@pytest.fixture(params=["native", "portable"])
def cpu_build(request):
    """Runs the test against the default build ("native") and against the portable one."""
    if request.param == "portable":
        return request.getfixturevalue("portable_build")
    return "native"
