"""The shared library of the CPU kernels (attention_ffi.cc and the files it calls, gemm.cc): built from this
folder's C++ sources on first use, cached, loaded, and its XLA FFI targets registered for attention.py and gemm.py.

The shared library is compiled with the system C++ compiler (`$CXX`, else `c++`) into a per-user cache,
`$XDG_CACHE_HOME/cbjax/kernels` (default `~/.cache/cbjax/kernels`), under a name that hashes every source file,
the flags, the compiler, jaxlib's version and the CPU (`-march=native`), so an edit or another machine builds anew
and concurrent builders never see a half-written file (temp file + rename). The FFI target's name carries the
same hash: a compiled step program saved to disk by another build names a target this process does not have,
so loading it fails (and the program cache compiles afresh) instead of running stale code.
A build is logged at INFO on the "cbjax" logger with its reason (nothing cached yet, or only other keys'
libraries: an edited source, another compiler, jaxlib or CPU) and its duration.

Built at install time too: setup.py's build step calls `build_prebuilt` into this folder's `prebuilt/` (of the wheel,
or of the source tree for an editable install), under the same name, so that a new user's first `LLM()` loads it
instead of compiling for ~20 s. The name carries the key, so a prebuilt library is loaded only when this process
would have built the very same one (same sources, flags, compiler, jaxlib and CPU); otherwise (a wheel installed on
another CPU, jaxlib upgraded since the install, an edited source) the runtime build above happens as before.

Build options (`$CBJAX_CPU_BUILD`, comma-separated; each is part of the cache key, so a variant never replaces
the default build): "no-avx512" compiles the portable loops that a CPU without AVX-512 runs (x86-64 only;
the suite tests them on this machine), "checked" makes an out-of-range page id or context length an error
instead of a clamp (attention_ffi.cc), "any-arch" builds on a machine that is not x86-64 (where the kernels are
neither tested nor measured, so by default they are not built there).

The library holds the attention (`attention_target()`), the packed-weight matmul of gemm.py (`gemm_target()`), the
KV row write (`kv_write_target()`) and the per-step token stream of a block of decode steps (`token_stream()`):
one build and one cache key for all of the CPU kernels; `features()` says what the loaded build was compiled with.

Each is None when the library cannot be used here (`unavailable_reason()` says why, in one line: not x86-64, a
source missing from the install, no compiler, or the compiler's first error lines); callers fall back to the XLA
path then, never crash. Importing this module does no work beyond registering an already-built library, which a
step program loaded from disk needs.
"""

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile
import threading
import time

import jax
import jaxlib

_HERE = pathlib.Path(__file__).parent
# Every file the library is built from, each .cc a translation unit; all of them go into the cache key and the
# targets' names. Listed by name, so that an install missing one says which (test_cpu_build.py checks that the
# list is this folder's *.cc and *.h, so a new file cannot be left out of the key).
SOURCE_NAMES = (
    "attention_common.h",
    "attention_ffi.cc",
    "build_info.cc",
    "decode_attention.cc",
    "gemm.cc",
    "kv_write.cc",
    "prefill_attention.cc",
    "token_stream.cc",
    "work_queue.h",
)
SOURCES = tuple(_HERE / name for name in SOURCE_NAMES)
_BASE_FLAGS = ("-O3", "-std=c++17", "-fopenmp-simd", "-fPIC", "-DNDEBUG")
BUILD_ENV_VAR = "CBJAX_CPU_BUILD"
# Build option -> its extra compiler flags (see the module docstring).
BUILD_OPTIONS = {"no-avx512": ("-mno-avx512f",), "checked": ("-DCBJAX_CHECKED=1",), "any-arch": ()}
_X86 = ("x86_64", "amd64", "i686", "i386")
# The bits build_info.cc's CbjaxCpuKernelsBuildInfo() returns.
_FEATURE_BITS = {"avx512f": 1, "avx2": 2, "checked": 4, "avx512bf16": 8}
_SYMBOL = "CbjaxCpuRaggedAttention"  # the attention's handler (attention_ffi.cc)
_LIBRARY_PREFIX = "cpu_kernels-"  # + the build options, the build key's hash + ".so", in the cache directory
# Libraries built at install time (setup.py), named as in the cache; read-only at run time.
PREBUILT_DIR = _HERE / "prebuilt"
# The other handlers (gemm.cc: the packed matmul; kv_write.cc): state key -> (symbol, FFI target prefix).
_HANDLER_SYMBOLS = {
    "gemm_target": ("CbjaxCpuPackedGemm", "cbjax_cpu_gemm"),
    "gemm_argmax_target": ("CbjaxCpuPackedGemmArgmax", "cbjax_cpu_gemm_argmax"),
    "gemm_bf16_target": ("CbjaxCpuPackedGemmBf16", "cbjax_cpu_gemm_bf16"),
    "gemm_argmax_bf16_target": ("CbjaxCpuPackedGemmArgmaxBf16", "cbjax_cpu_gemm_argmax_bf16"),
    "kv_write_target": ("CbjaxCpuWriteKvRows", "cbjax_cpu_kv_write"),
    "token_stream_target": ("CbjaxCpuStreamTokens", "cbjax_cpu_token_stream"),
}
_lock = threading.Lock()
_state: dict = {}  # "lib", "target" and _HANDLER_SYMBOLS' keys once registered; "error" once failed
# Libraries loaded and registered by this process, by path: fresh_state() forgets _state, and entering it again
# reuses these rather than registering the same targets with jax twice.
_loaded: dict[pathlib.Path, dict] = {}
_log = logging.getLogger("cbjax")


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "c++"))


def _machine() -> str:
    return platform.machine().lower()


def build_options() -> tuple[str, ...]:
    """The options of `$CBJAX_CPU_BUILD`, sorted; ValueError on an unknown one."""
    raw = [o.strip() for o in os.environ.get(BUILD_ENV_VAR, "").split(",") if o.strip()]
    unknown = sorted(set(raw) - set(BUILD_OPTIONS))
    if unknown:
        raise ValueError(f"{BUILD_ENV_VAR} options must be among {sorted(BUILD_OPTIONS)}, got {unknown}")
    return tuple(sorted(set(raw)))


def flags() -> tuple[str, ...]:
    """The compiler flags of this process's build: -march=native on x86-64 (-mcpu=native elsewhere, the spelling
    every compiler there accepts) and the build options' flags ("no-avx512" only on x86-64: elsewhere there is
    no AVX-512 to turn off)."""
    options = build_options()
    if _machine() in _X86:
        arch = "-march=native"
    else:
        arch, options = "-mcpu=native", tuple(o for o in options if o != "no-avx512")
    return (*_BASE_FLAGS, arch, *(f for o in options for f in BUILD_OPTIONS[o]))


def _cpu_signature() -> str:
    """What -march=native depends on: the CPU's model and feature flags (Linux), else the machine name."""
    try:
        lines = pathlib.Path("/proc/cpuinfo").read_text().splitlines()
        keep = [l for l in lines if l.startswith(("model name", "flags"))]
        return "\n".join(sorted(set(keep)))
    except OSError:
        return platform.machine() + platform.processor()


def unbuildable_reason() -> str | None:
    """Why the library cannot be built here at all, in one line, before trying: a machine that is not x86-64
    (without the "any-arch" option), a bad `$CBJAX_CPU_BUILD`, a source missing from the install, or no
    compiler. None if a build can be tried."""
    try:
        options = build_options()
    except ValueError as e:
        return str(e)
    if _machine() not in _X86 and "any-arch" not in options:
        return (
            f"the C++ kernels are tested and measured on x86-64 only, this machine is {platform.machine()} "
            f"({BUILD_ENV_VAR}=any-arch builds them anyway)"
        )
    missing = [f for f in SOURCES if not f.is_file()]
    if missing:
        where = ", ".join(sorted({str(f.parent) for f in missing}))
        names = ", ".join(f.name for f in missing)
        return f"source file(s) missing from {where}: {names} (an install without its package data: reinstall cbjax)"
    if _compiler() is None:
        return f"no C++ compiler: {os.environ.get('CXX', 'c++')!r} is not on PATH (set $CXX to one)"
    return None


@functools.cache
def build_key() -> tuple[str, str] | None:
    """(hash, compiler path) of the library this process builds or loads, or None when `unbuildable_reason()`
    says it cannot be built. The hash covers every file of `SOURCES` (name and bytes), the flags (the build
    options' included), the compiler, jaxlib's version and the CPU. Cheap: no subprocess (a stat of the compiler).
    Cached for the process: after changing `$CXX`, `$CBJAX_CPU_BUILD` or `SOURCES` call `build_key.cache_clear()`
    (or use `fresh_state()`)."""
    if unbuildable_reason() is not None:
        return None
    cxx = _compiler()
    real = os.path.realpath(cxx)
    st = os.stat(real)
    h = hashlib.sha256()
    for f in SOURCES:
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    for part in (repr(flags()).encode(), f"{real}:{st.st_size}:{st.st_mtime_ns}".encode()):
        h.update(part)
    h.update(jaxlib.__version__.encode())
    h.update(_cpu_signature().encode())
    return h.hexdigest()[:16], cxx


def _cache_dir() -> pathlib.Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "cbjax" / "kernels"


def _library_path(digest: str) -> pathlib.Path:
    variant = "".join(f"{o}-" for o in build_options())  # for whoever lists the cache; the hash has them too
    return _cache_dir() / f"{_LIBRARY_PREFIX}{variant}{digest}.so"


def find_library() -> pathlib.Path | None:
    """The built library of this process's key: the one in the cache, else the one built at install time (in
    `PREBUILT_DIR`, under the same name); None if neither exists (a build is due) or none can be built here."""
    key = build_key()
    if key is None:
        return None
    path = _library_path(key[0])
    for candidate in (path, PREBUILT_DIR / path.name):
        if candidate.is_file():
            return candidate
    return None


def _build_reason(path: pathlib.Path) -> str:
    """Why `path` is about to be built, for the log: nothing cached yet, or only other keys' libraries."""
    others = sorted(path.parent.glob(f"{_LIBRARY_PREFIX}*.so")) if path.parent.is_dir() else []
    if not others:
        return f"no CPU kernel library cached in {path.parent} yet"
    return (
        f"{len(others)} other build(s) cached in {path.parent}, none of this key: a source, the flags, the "
        "compiler, jaxlib or the CPU changed"
    )


class BuildError(RuntimeError):
    """A compile or link step failed; the message is one line (the compiler's first error lines)."""


def _first_errors(stderr: str, n: int = 2) -> str:
    """The compiler's first `n` lines that say "error" (else its first lines), joined into one line, with this
    folder's path left out."""
    lines = [l.replace(f"{_HERE}{os.sep}", "").strip() for l in stderr.splitlines() if l.strip()]
    errors = [l for l in lines if "error" in l.lower()] or lines
    return " | ".join(l[:240] for l in errors[:n]) or "no output"


def _run_all(jobs: list[tuple[str, list[str]]]) -> None:
    """Runs the (what, command) jobs at once; BuildError naming the first that failed, with its first errors (the
    compiler's whole message goes to the debug log)."""
    procs = [(what, cmd, subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
             for what, cmd in jobs]  # fmt: skip
    try:
        for what, cmd, proc in procs:
            _, err = proc.communicate(timeout=300)
            if proc.returncode != 0:
                _log.debug("cbjax: %s failed: %s\n%s", what, " ".join(cmd), err)
                raise BuildError(f"{what} with {cmd[0]} failed (exit {proc.returncode}): {_first_errors(err)}")
    finally:  # after a failure, the other compilers must not write into a folder that is being removed
        for _, _, proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _build(cxx: str, path: pathlib.Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    os.close(fd)
    opts = flags()
    try:
        with tempfile.TemporaryDirectory(dir=path.parent) as objs:
            # One compiler per translation unit, all at once (they take ~10 s each), then one link.
            units = [f for f in SOURCES if f.suffix == ".cc"]
            include = ("-isystem", jax.ffi.include_dir())
            _run_all([(f"compiling {f.name}", [cxx, *opts, *include, "-c", str(f), "-o", f"{objs}/{f.stem}.o"])
                      for f in units])  # fmt: skip
            objects = [f"{objs}/{f.stem}.o" for f in units]
            _run_all([("linking the CPU kernels", [cxx, *opts, "-shared", *objects, "-o", tmp])])
        os.replace(tmp, path)  # atomic: a concurrent builder or reader sees no half-written library
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _register(path: pathlib.Path, digest: str) -> None:
    if path not in _loaded:
        lib = ctypes.cdll.LoadLibrary(str(path))
        entry = {"lib": lib, "path": path, "target": f"cbjax_cpu_attention_{digest}"}
        jax.ffi.register_ffi_target(entry["target"], jax.ffi.pycapsule(getattr(lib, _SYMBOL)), platform="cpu")
        for key, (symbol, prefix) in _HANDLER_SYMBOLS.items():
            entry[key] = f"{prefix}_{digest}"
            jax.ffi.register_ffi_target(entry[key], jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
        bits = lib.CbjaxCpuKernelsBuildInfo()
        entry["features"] = {name: bool(bits & bit) for name, bit in _FEATURE_BITS.items()}
        _loaded[path] = entry
    _state.update(_loaded[path])


def _ensure(build: bool) -> str | None:
    """The registered target's name, building the library first if `build`; None if unavailable."""
    with _lock:
        if "target" in _state or "error" in _state:
            return _state.get("target")
        reason = unbuildable_reason()
        if reason is not None:
            _state["error"] = reason
            return None
        digest, cxx = build_key()
        path = find_library() or _library_path(digest)
        try:
            if not path.is_file():
                if not build:
                    return None
                _log.info("cbjax: building the CPU kernels into %s (%s)", path, _build_reason(path))
                start = time.perf_counter()
                _build(cxx, path)
                _log.info("cbjax: built the CPU kernels in %.1f s", time.perf_counter() - start)
            _register(path, digest)
        except BuildError as e:
            _state["error"] = str(e)
            return None
        except Exception as e:  # a failed load or a timeout: report it in one line, let the caller take XLA's path
            _state["error"] = f"{type(e).__name__}: {' '.join(str(e).split())}"
            return None
        return _state["target"]


def build_prebuilt(directory: pathlib.Path) -> pathlib.Path:
    """Build this process's library into `directory` (setup.py's install-time build), under the name the run time
    looks for (`PREBUILT_DIR`), and return its path; other libraries there (older keys) are removed. BuildError
    (one line) when it cannot be built here (`unbuildable_reason()`) or the compiler fails."""
    reason = unbuildable_reason()
    if reason is not None:
        raise BuildError(reason)
    digest, cxx = build_key()
    directory = pathlib.Path(directory)
    path = directory / _library_path(digest).name
    for old in directory.glob(f"{_LIBRARY_PREFIX}*.so") if directory.is_dir() else ():
        if old != path:
            old.unlink()
    _build(cxx, path)
    return path


def library_path() -> pathlib.Path | None:
    """The file of the library this process loaded: in the cache, or in `PREBUILT_DIR` (built at install time);
    None if none is loaded (call a `*_target()` first)."""
    return _state.get("path")


def compiler_found() -> bool:
    """Whether a C++ compiler is on PATH (without one the kernels cannot be built here)."""
    return _compiler() is not None


def unavailable_reason() -> str | None:
    """Why the library is unavailable, in one line (None if it is available or was not asked for yet)."""
    return _state.get("error")


def features() -> dict[str, bool] | None:
    """What the loaded library was compiled with: "avx512f" (the AVX-512 fast paths), "avx2", "checked",
    "avx512bf16" (the bf16 matmul's vdpbf16ps path; without it the bf16 handlers run a portable loop); None
    if no library is loaded (call a `*_target()` first)."""
    return _state.get("features")


def attention_target() -> str | None:
    """The registered FFI target of the attention handler (attention.py), building the library first if needed;
    None if it is unavailable (see `unavailable_reason`)."""
    return _ensure(build=True)


def gemm_target(argmax: bool = False, bf16: bool = False) -> str | None:
    """The registered FFI target of the packed-weight matmul (gemm.py), or with `argmax` of its row-wise argmax,
    with `bf16` of the bfloat16 variants, building the library first if needed; None if it is unavailable (see
    `unavailable_reason`)."""
    if _ensure(build=True) is None:
        return None
    return _state.get(f"gemm{'_argmax' if argmax else ''}{'_bf16' if bf16 else ''}_target")


def kv_write_target() -> str | None:
    """The registered FFI target of the in-place KV row write (kv_write.cc, kernels_pallas/kv_write.py), building
    the library first if needed; None if it is unavailable (see `unavailable_reason`)."""
    if _ensure(build=True) is None:
        return None
    return _state.get("kv_write_target")


def token_stream() -> tuple[str, object] | None:
    """(the registered FFI target of the per-step token stream of a block of decode steps, the library's
    `CbjaxStreamTake` as a ctypes function: token_stream.cc, cbjax/runner/token_stream.py), building the library
    first if needed; None if it is unavailable (see `unavailable_reason`)."""
    if _ensure(build=True) is None:
        return None
    take = _state["lib"].CbjaxStreamTake
    take.restype = ctypes.c_int
    take.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_uint32, ctypes.c_uint32, ctypes.c_void_p,
                     ctypes.c_uint32, ctypes.c_int64]  # fmt: skip
    return _state["token_stream_target"], take


@contextlib.contextmanager
def fresh_state():
    """For tests that change `$CXX`, `$XDG_CACHE_HOME`, `$CBJAX_CPU_BUILD` or `SOURCES`: inside the block this
    process has no build state (no library registered, no error, `build_key` recomputed), so the next `*_target()`
    looks for the compiler, the cached library and the sources anew (a library this process loaded before is
    registered again from memory, never twice with jax). On exit the state from before the block (the library
    registered, or the reason there is none) comes back. Targets registered inside the block stay registered
    with jax (jax cannot unregister them)."""
    with _lock:
        saved = dict(_state)
        _state.clear()
    build_key.cache_clear()
    try:
        yield
    finally:
        with _lock:
            _state.clear()
            _state.update(saved)
        build_key.cache_clear()


def default_num_threads() -> int:
    """The CPUs this process may run on (the kernel splits its work items over that many threads)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


# A step program saved to disk by an earlier process may call the kernel without this process tracing it:
# register an already-built library now (cheap; never compiles at import).
_ensure(build=False)
