"""The CPU kernels' library as an install meets it (kernels_pallas/cpu/library.py, auto.py): the source list, the
one-line reason for every way a build cannot happen, the portable build really being the portable code, the
checked build refusing corrupted metadata that the default build clamps, and `auto`'s table per build. The
kernels' exactness under both builds: the `cpu_build` tests of test_cpu_decode_attention.py,
test_cpu_prefill_attention.py and test_cpu_gemm.py (conftest.py)."""

import platform

import jax
import numpy as np
import pytest

from kernels_pallas.cpu import attention as cpu_attention
from kernels_pallas.cpu import auto, gemm, library
from tests.kernels.test_cpu_decode_attention import needs_kernel
from tests.kernels.test_xla_attention import make_case


def test_the_source_list_is_this_folders_sources():
    """SOURCE_NAMES is what the build compiles and hashes: a new .cc or .h must be added to it."""
    here = library.SOURCES[0].parent
    assert set(library.SOURCE_NAMES) == {f.name for f in [*here.glob("*.cc"), *here.glob("*.h")]}


def one_line(reason):
    assert reason and "\n" not in reason and len(reason) < 600, reason
    return reason


def test_a_missing_source_is_named(monkeypatch, tmp_path):
    monkeypatch.setattr(library, "SOURCES", (*library.SOURCES, tmp_path / "attention_gone.h"))
    with library.fresh_state():
        reason = one_line(library.unbuildable_reason())
        assert "missing" in reason and "attention_gone.h" in reason and str(tmp_path) in reason
        assert library.build_key() is None
        assert not cpu_attention.available() and cpu_attention.unavailable_reason() == reason


def test_a_machine_that_is_not_x86_gets_no_build_unless_asked(monkeypatch):
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    monkeypatch.delenv(library.BUILD_ENV_VAR, raising=False)
    with library.fresh_state():
        reason = one_line(library.unbuildable_reason())
        assert "x86-64 only" in reason and "aarch64" in reason and "any-arch" in reason
        assert not gemm.available() and gemm.unavailable_reason() == reason
        assert auto.auto_reason("decode_attention") == reason  # `auto` falls back, saying why
    monkeypatch.setenv(library.BUILD_ENV_VAR, "any-arch,checked,no-avx512")
    assert "-mcpu=native" in library.flags() and "-march=native" not in library.flags()
    assert "-DCBJAX_CHECKED=1" in library.flags() and "-mno-avx512f" not in library.flags()
    if library.compiler_found():
        assert library.unbuildable_reason() is None


def test_an_unknown_build_option_is_the_reason(monkeypatch):
    monkeypatch.setenv(library.BUILD_ENV_VAR, "no-avx512,fast")
    with pytest.raises(ValueError, match="fast"):
        library.build_options()
    assert "fast" in one_line(library.unbuildable_reason())


def test_build_options_change_the_key_and_the_flags(monkeypatch):
    if not library.compiler_found():
        pytest.skip("no C++ compiler: there is no build key")
    keys = set()
    for options in ("", "no-avx512", "checked", "checked,no-avx512", "no-avx512,checked"):
        monkeypatch.setenv(library.BUILD_ENV_VAR, options)
        library.build_key.cache_clear()
        keys.add(library.build_key()[0])
    library.build_key.cache_clear()
    assert len(keys) == 4  # the order of the options does not matter
    assert "-mno-avx512f" in library.flags() and "-DCBJAX_CHECKED=1" in library.flags()


def test_a_compile_error_is_its_first_lines_in_one_line(monkeypatch, tmp_path):
    if not library.compiler_found():
        pytest.skip("no C++ compiler")
    broken = tmp_path / "broken.cc"
    broken.write_text("int fine = 1;\nint broken = ;\nint also_broken = ;\n")
    monkeypatch.setattr(library, "SOURCES", (broken,))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    with library.fresh_state():
        assert not cpu_attention.available()
        reason = one_line(cpu_attention.unavailable_reason())
        assert reason.startswith("compiling broken.cc with ") and "failed (exit 1)" in reason, reason
        assert "broken.cc:2:" in reason and "error" in reason, reason
    assert not list((tmp_path / "cache").rglob("*.so")), "a failed build must leave no library behind"


# ---- the portable build: the code a CPU without AVX-512 runs -------------------------------------------------


@needs_kernel
def test_calls_under_the_portable_build_name_its_targets(portable_build):
    """What the `cpu_build` tests rely on: inside the fixture, the kernels' calls go to the portable library."""
    assert "no-avx512" in library.build_options() and library.build_key()[0] in library.attention_target()
    args = make_case(np.random.default_rng(0), [1, 4], [9, 4])
    hlo = jax.jit(cpu_attention.cpu_ragged_attention).lower(*args).as_text()
    assert library.attention_target() in hlo
    x, w = np.ones((3, 8), np.float32), np.ones((8, 40), np.float32)
    hlo = jax.jit(lambda x, w: gemm.packed_matmul(x, w, 40)).lower(x, gemm.pack_weight(w)).as_text()
    assert library.gemm_target() in hlo


# ---- the checked build: corrupted metadata is an error ----------------------------------------------------------


def corrupted(args, **changes):
    """A copy of the metadata of `args` with entries changed: {"pt": {(i, j): v}, "kv": {i: v}, "cu": {i: v}}."""
    q, k, v, kv, pt, cu, ns = args
    kv, pt, cu = kv.copy(), pt.copy(), cu.copy()
    for (i, j), value in changes.get("pt", {}).items():
        pt[i, j] = value
    for i, value in changes.get("kv", {}).items():
        kv[i] = value
    for i, value in changes.get("cu", {}).items():
        cu[i] = value
    return q, k, v, kv, pt, cu, ns


def run(args, **kw):
    return np.asarray(jax.block_until_ready(cpu_attention.cpu_ragged_attention(*args, **kw)))


# A decode of 20 tokens and a prefill of 5 after 4 of context (G = 8: pages 0-2 and 0-1 of their rows used).
CASE = dict(q_lens=[1, 5], kv_lens=[20, 9], G=8)


@needs_kernel
@pytest.mark.parametrize(
    "changes, message",
    [
        ({"pt": {(0, 2): 10**6}}, r"page_indices\[0, 2\] = 1000000 is outside \[0, P = "),
        ({"pt": {(1, 0): -1}}, r"page_indices\[1, 0\] = -1 is outside"),
        ({"kv": {1: 10**4}}, r"kv_lens\[1\] = 10000 is outside \[0, W \* G = "),
        ({"cu": {1: 0, 2: 0}}, None),  # an empty decode slot: allowed
        ({"cu": {2: 99}}, r"cu_q_lens\[2\] = 99 after cu_q_lens\[1\] = 1: not rising within \[0, T = "),
    ],
)
def test_the_checked_build_refuses_corrupted_metadata(portable_build, changes, message):
    args = make_case(np.random.default_rng(1), CASE["q_lens"], CASE["kv_lens"], G=CASE["G"])
    good = run(args)
    assert np.all(np.isfinite(good))
    bad = corrupted(args, **changes)
    if message is None:
        run(bad)
        return
    with pytest.raises((ValueError, jax.errors.JaxRuntimeError), match=message):  # INVALID_ARGUMENT: a ValueError
        run(bad)


@needs_kernel
def test_the_checked_build_ignores_entries_it_never_reads(portable_build):
    """Entries before a sliding window's start (their pages may be freed) and past the context are never read."""
    args = make_case(np.random.default_rng(2), CASE["q_lens"], CASE["kv_lens"], G=CASE["G"])
    want = run(args, sliding_window=4)
    got = run(corrupted(args, pt={(0, 0): -7, (0, 1): 10**6, (0, 3): 10**6}), sliding_window=4)
    np.testing.assert_array_equal(got, want)


@needs_kernel
def test_the_default_build_clamps_what_the_checked_build_refuses():
    """Why the checked build exists: the default build reads some valid page instead and says nothing."""
    if library.features()["checked"]:
        pytest.skip(f"{library.BUILD_ENV_VAR} asks for the checked build in this process")
    args = make_case(np.random.default_rng(1), CASE["q_lens"], CASE["kv_lens"], G=CASE["G"])
    got = run(corrupted(args, pt={(0, 2): 10**6}))
    assert got.shape == args[0].shape  # no error: rows of sequence 0 attend over whatever page P - 1 holds


# ---- `auto` per build ------------------------------------------------------------------------------------------


@needs_kernel
def test_auto_takes_what_the_table_says_for_the_build_here():
    kind = auto.build_kind()
    assert kind == ("avx512" if library.features()["avx512f"] else "portable")
    for kernel in auto.KERNELS:
        needs = auto.REQUIRES.get(kernel)
        takes = kernel in auto.AUTO_TAKES[kind] and (needs is None or library.features()[needs])
        assert (auto.auto_reason(kernel) is None) == takes, kernel
    with pytest.raises(ValueError, match="kernel"):
        auto.auto_reason("attention")


@needs_kernel
def test_auto_under_the_portable_build_says_why_it_takes_xla(portable_build):
    assert auto.build_kind() == "portable"
    for kernel in auto.KERNELS:
        reason = auto.auto_reason(kernel)
        if kernel in auto.AUTO_TAKES["portable"]:
            assert reason is None
        else:
            assert "without AVX-512" in one_line(reason) and "no-avx512" in reason and "docs/kernels.md" in reason


@needs_kernel
def test_the_engines_auto_choices_follow_the_table(portable_build, monkeypatch):
    """xla_attention.py's decode_impl / prefill_impl and linear_impl.py's cpu_matmul ask auto.py; explicit choices
    still run the kernel on any build."""
    from cbjax.model import get_model_config, init_model
    from cbjax.model.linear_impl import resolve_cpu_matmul
    from kernels_pallas.xla_attention import resolve_decode_impl, resolve_prefill_impl

    for var in ("CBJAX_DECODE_ATTENTION", "CBJAX_PREFILL_ATTENTION", "CBJAX_MATMUL"):
        monkeypatch.delenv(var, raising=False)
    model = init_model(get_model_config("test-tiny"), seed=0)
    taken = auto.AUTO_TAKES["portable"]
    assert resolve_decode_impl("auto") == ("ffi" if "decode_attention" in taken else "xla")
    assert resolve_prefill_impl("auto") == ("ffi" if "prefill_attention" in taken else "xla")
    assert resolve_cpu_matmul("auto", model) == ("packed" if "matmul" in taken else "xla")
    assert resolve_prefill_impl("ffi") == "ffi" and resolve_cpu_matmul("packed", model) == "packed"
