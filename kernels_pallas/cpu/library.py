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

The library holds the attention (`attention_target()`) and the packed-weight matmul of gemm.py (`gemm_target()`):
one build and one cache key for all of the CPU kernels.

Both are None when the library cannot be used here (`unavailable_reason()` says why: there is no
compiler or the build fails); callers fall back to the XLA path then, never crash. Importing this module does
no work beyond registering an already-built library, which a step program loaded from disk needs.
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
# Every file the library is built from, each .cc a translation unit: all of them go into the cache key and the
# targets' names (a glob, so that a new file cannot be left out of the key).
SOURCES = tuple(sorted([*_HERE.glob("*.cc"), *_HERE.glob("*.h")]))
_FLAGS = ("-O3", "-march=native", "-std=c++17", "-fopenmp-simd", "-fPIC", "-DNDEBUG")
_SYMBOL = "CbjaxCpuRaggedAttention"  # the attention's handler (attention_ffi.cc)
_LIBRARY_PREFIX = "cpu_kernels-"  # + the build key's hash + ".so", in the cache directory
# The packed matmul's handlers (gemm.cc): state key -> (symbol, FFI target prefix).
_GEMM_SYMBOLS = {
    "gemm_target": ("CbjaxCpuPackedGemm", "cbjax_cpu_gemm"),
    "gemm_argmax_target": ("CbjaxCpuPackedGemmArgmax", "cbjax_cpu_gemm_argmax"),
}
_lock = threading.Lock()
_state: dict = {}  # "lib", "target" and _GEMM_SYMBOLS' keys once registered; "error" once failed
_log = logging.getLogger("cbjax")


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "c++"))


def _cpu_signature() -> str:
    """What -march=native depends on: the CPU's model and feature flags (Linux), else the machine name."""
    try:
        lines = pathlib.Path("/proc/cpuinfo").read_text().splitlines()
        keep = [l for l in lines if l.startswith(("model name", "flags"))]
        return "\n".join(sorted(set(keep)))
    except OSError:
        return platform.machine() + platform.processor()


@functools.cache
def build_key() -> tuple[str, str] | None:
    """(hash, compiler path) of the library this process builds or loads, or None without a compiler (or with a
    source missing). The hash covers every file of `SOURCES` (name and bytes), the flags, the compiler, jaxlib's
    version and the CPU. Cheap: no subprocess (a stat of the compiler). Cached for the process: after changing
    `$CXX` or `SOURCES` call `build_key.cache_clear()` (or use `fresh_state()`)."""
    cxx = _compiler()
    if cxx is None or not all(f.is_file() for f in SOURCES):
        return None
    real = os.path.realpath(cxx)
    st = os.stat(real)
    h = hashlib.sha256()
    for f in SOURCES:
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    for part in (repr(_FLAGS).encode(), f"{real}:{st.st_size}:{st.st_mtime_ns}".encode()):
        h.update(part)
    h.update(jaxlib.__version__.encode())
    h.update(_cpu_signature().encode())
    return h.hexdigest()[:16], cxx


def _cache_dir() -> pathlib.Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "cbjax" / "kernels"


def _library_path(digest: str) -> pathlib.Path:
    return _cache_dir() / f"{_LIBRARY_PREFIX}{digest}.so"


def _build_reason(path: pathlib.Path) -> str:
    """Why `path` is about to be built, for the log: nothing cached yet, or only other keys' libraries."""
    others = sorted(path.parent.glob(f"{_LIBRARY_PREFIX}*.so")) if path.parent.is_dir() else []
    if not others:
        return f"no CPU kernel library cached in {path.parent} yet"
    return (
        f"{len(others)} other build(s) cached in {path.parent}, none of this key: a source, the flags, the "
        "compiler, jaxlib or the CPU changed"
    )


def _build(cxx: str, path: pathlib.Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        with tempfile.TemporaryDirectory(dir=path.parent) as objs:
            # One compiler per translation unit, all at once (they take ~10 s each), then one link.
            units = [f for f in SOURCES if f.suffix == ".cc"]
            cmds = [
                [cxx, *_FLAGS, "-isystem", jax.ffi.include_dir(), "-c", str(f), "-o", f"{objs}/{f.stem}.o"]
                for f in units
            ]
            procs = [subprocess.Popen(c, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for c in cmds]
            for cmd, proc in zip(cmds, procs):
                _, err = proc.communicate(timeout=300)
                if proc.returncode != 0:
                    raise RuntimeError(f"{' '.join(cmd)} failed:\n{err[-4000:]}")
            cmd = [cxx, *_FLAGS, "-shared", *(f"{objs}/{f.stem}.o" for f in units), "-o", tmp]
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            if res.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed:\n{res.stderr[-4000:]}")
        os.replace(tmp, path)  # atomic: a concurrent builder or reader sees no half-written library
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _register(path: pathlib.Path, digest: str) -> None:
    lib = ctypes.cdll.LoadLibrary(str(path))
    target = f"cbjax_cpu_attention_{digest}"
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, _SYMBOL)), platform="cpu")
    _state.update(lib=lib, target=target)
    for key, (symbol, prefix) in _GEMM_SYMBOLS.items():
        name = f"{prefix}_{digest}"
        jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
        _state[key] = name


def _ensure(build: bool) -> str | None:
    """The registered target's name, building the library first if `build`; None if unavailable."""
    with _lock:
        if "target" in _state or "error" in _state:
            return _state.get("target")
        key = build_key()
        if key is None:
            _state["error"] = f"no C++ compiler found ({os.environ.get('CXX', 'c++')!r} not on PATH)"
            return None
        digest, cxx = key
        path = _library_path(digest)
        try:
            if not path.is_file():
                if not build:
                    return None
                _log.info("cbjax: building the CPU kernels into %s (%s)", path, _build_reason(path))
                start = time.perf_counter()
                _build(cxx, path)
                _log.info("cbjax: built the CPU kernels in %.1f s", time.perf_counter() - start)
            _register(path, digest)
        except Exception as e:  # a failed build or load: report it, let the caller take the XLA path
            _state["error"] = f"{type(e).__name__}: {e}"
            return None
        return _state["target"]


def compiler_found() -> bool:
    """Whether a C++ compiler is on PATH (without one the kernels cannot be built here)."""
    return _compiler() is not None


def unavailable_reason() -> str | None:
    """Why the library is unavailable (None if it is available or was not asked for yet)."""
    return _state.get("error")


def attention_target() -> str | None:
    """The registered FFI target of the attention handler (attention.py), building the library first if needed;
    None if it is unavailable (see `unavailable_reason`)."""
    return _ensure(build=True)


def gemm_target(argmax: bool = False) -> str | None:
    """The registered FFI target of the packed-weight matmul (gemm.py), or with `argmax` of its row-wise argmax,
    building the library first if needed; None if it is unavailable (see `unavailable_reason`)."""
    if _ensure(build=True) is None:
        return None
    return _state.get("gemm_argmax_target" if argmax else "gemm_target")


@contextlib.contextmanager
def fresh_state():
    """For tests that change `$CXX`, `$XDG_CACHE_HOME` or `SOURCES`: inside the block this process has no build
    state (no library registered, no error, `build_key` recomputed), so the next `*_target()` looks for the
    compiler, the cached library and the sources anew. On exit the state from before the block (the library
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
