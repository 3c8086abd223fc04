"""Paged attention for CPU: a C++ XLA FFI custom call (cpu_attention_ffi.cc and the files it calls), built on first use.

XLA:CPU lowers the loops of xla_attention.py to page-block gathers and tiny batched dots (~2-3 GB/s of K/V for
decode; prefill blocks rebuild masks and gathers per block); the C++ handler walks the page table and does q . K
and p . V in registers. `cpu_ragged_attention` fills the rows of decode sequences (q_len 1,
cpu_decode_attention.cc), of prefill sequences (q_len > 1, cpu_prefill_attention.cc), or both, and leaves every
other row zero (for the XLA path to fill, when it does the other kind). `cpu_decode_attention` is its decode-only
form.

The shared library is compiled with the system C++ compiler (`$CXX`, else `c++`) into a per-user cache,
`$XDG_CACHE_HOME/cbjax/kernels` (default `~/.cache/cbjax/kernels`), under a name that hashes every source file,
the flags, the compiler, jaxlib's version and the CPU (`-march=native`), so an edit or another machine builds anew
and concurrent builders never see a half-written file (temp file + rename). The FFI target's name carries the
same hash: a compiled step program saved to disk by another build names a target this process does not have,
so loading it fails (and the program cache compiles afresh) instead of running stale code.

The library also holds the packed-weight matmul of cpu_gemm.py (`gemm_target()`): one build and one cache key
for all of the CPU kernels.

`available()` says whether the kernel can be used here (False, with `unavailable_reason()`, when there is no
compiler or the build fails); callers fall back to the XLA path then, never crash. Importing this module does
no work beyond registering an already-built library, which a step program loaded from disk needs.
"""

import ctypes
import functools
import hashlib
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile
import threading

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

from kernels_pallas import kv_quant

_HERE = pathlib.Path(__file__).parent
# Every file the library is built from: all of them go into the cache key and the target's name.
_SOURCES = tuple(
    _HERE / name
    for name in (
        "cpu_attention_common.h",
        "cpu_work_queue.h",  # the work items' queue shared by the calling thread and XLA's pool (both handlers)
        "cpu_decode_attention.cc",
        "cpu_prefill_attention.cc",
        "cpu_attention_ffi.cc",
        "cpu_gemm.cc",  # the packed-weight matmul (cpu_gemm.py): one library, one build, one cache key
    )
)
_FLAGS = ("-O3", "-march=native", "-std=c++17", "-fopenmp-simd", "-fPIC", "-DNDEBUG")
_SYMBOL = "CbjaxCpuRaggedAttention"
# The packed matmul's handlers (cpu_gemm.cc): state key -> (symbol, FFI target prefix).
_GEMM_SYMBOLS = {
    "gemm_target": ("CbjaxCpuPackedGemm", "cbjax_cpu_gemm"),
    "gemm_argmax_target": ("CbjaxCpuPackedGemmArgmax", "cbjax_cpu_gemm_argmax"),
}
ROWS = {"decode": 1, "prefill": 2, "both": 3}  # which sequences' rows a call fills (the handler's `rows`)
_lock = threading.Lock()
_state: dict = {}  # "lib", "target" and _GEMM_SYMBOLS' keys once registered; "error" once failed


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
def _build_key() -> tuple[str, str] | None:
    """(hash, compiler path), or None without a compiler. Cheap: no subprocess (a stat of the compiler)."""
    cxx = _compiler()
    if cxx is None or not all(f.is_file() for f in _SOURCES):
        return None
    real = os.path.realpath(cxx)
    st = os.stat(real)
    h = hashlib.sha256()
    for f in _SOURCES:
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
    return _cache_dir() / f"cpu_attention-{digest}.so"


def _build(cxx: str, path: pathlib.Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        with tempfile.TemporaryDirectory(dir=path.parent) as objs:
            # One compiler per translation unit, all at once (they take ~10 s each), then one link.
            units = [f for f in _SOURCES if f.suffix == ".cc"]
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
        key = _build_key()
        if key is None:
            _state["error"] = f"no C++ compiler found ({os.environ.get('CXX', 'c++')!r} not on PATH)"
            return None
        digest, cxx = key
        path = _library_path(digest)
        try:
            if not path.is_file():
                if not build:
                    return None
                _build(cxx, path)
            _register(path, digest)
        except Exception as e:  # a failed build or load: report it, let the caller take the XLA path
            _state["error"] = f"{type(e).__name__}: {e}"
            return None
        return _state["target"]


def available() -> bool:
    """True if the FFI kernel is built (building it now if needed) and registered in this process."""
    return _ensure(build=True) is not None


def compiler_found() -> bool:
    """Whether a C++ compiler is on PATH (without one the kernel cannot be built here)."""
    return _compiler() is not None


def unavailable_reason() -> str | None:
    """Why `available()` is False (None if it is True or was not asked yet)."""
    return _state.get("error")


def gemm_target(argmax: bool = False) -> str | None:
    """The registered FFI target of the packed-weight matmul in the same library (cpu_gemm.py), or with `argmax`
    of its row-wise argmax, building the library first if needed; None if it is unavailable (see
    `unavailable_reason`)."""
    if _ensure(build=True) is None:
        return None
    return _state.get("gemm_argmax_target" if argmax else "gemm_target")


def default_num_threads() -> int:
    """The CPUs this process may run on (the kernel splits its work items over that many threads)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def cpu_ragged_attention(
    q,
    k_pages,
    v_pages,
    kv_lens,
    page_indices,
    cu_q_lens,
    num_seqs,
    *,
    rows: str = "both",
    sm_scale: float | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    num_threads: int | None = None,
    k_scales=None,
    v_scales=None,
):
    """Ragged paged attention over the cache: [T, N, H] in q's dtype. `rows` picks the sequences whose rows are
    filled (all heads): "decode" (q_len 1), "prefill" (q_len > 1) or "both"; every other row is zero. Shapes and
    masking rules: docs/kernels.md. q float32 or bfloat16; k_pages and v_pages one of those too (may differ from
    q's: a float32 model with a bfloat16 cache), or int8 with their float32 scales k_scales / v_scales
    [K, P, G, 1] (kernels_pallas/kv_quant.py). `num_threads` (default: this process's CPUs) caps the threads the
    kernel uses (1: the calling thread only). Jittable; runs on the CPU backend only. Raises RuntimeError if the
    kernel is unavailable (see `available`)."""
    target = _ensure(build=True)
    if target is None:
        raise RuntimeError(f"the CPU attention kernel is unavailable: {unavailable_reason()}")
    if rows not in ROWS:
        raise ValueError(f"rows must be one of {tuple(ROWS)}, got {rows!r}")
    q, k_pages, v_pages = (jnp.asarray(x) for x in (q, k_pages, v_pages))
    if q.ndim != 3 or k_pages.ndim != 4 or v_pages.shape != k_pages.shape:
        raise ValueError(
            f"expected q [T, N, H], k/v pages [K, P, G, H]; got {q.shape}, {k_pages.shape}, {v_pages.shape}"
        )
    floats = (jnp.float32, jnp.bfloat16)
    if k_pages.dtype != v_pages.dtype or q.dtype not in floats or k_pages.dtype not in (*floats, jnp.int8):
        raise ValueError(
            "q must be float32 or bfloat16 and k_pages = v_pages that or int8, got "
            f"{q.dtype}, {k_pages.dtype}, {v_pages.dtype}"
        )
    kv_quant.check_scales(k_pages, v_pages, k_scales, v_scales)
    if k_scales is None:  # the handler takes scale buffers always; float pages ignore them
        k_scales = v_scales = jnp.zeros((1,), jnp.float32)
    T, N, H = q.shape
    K = k_pages.shape[0]
    if k_pages.shape[3] != H or N % K:
        raise ValueError(f"head dims differ or N={N} is not a multiple of K={K}")
    i32 = lambda x: jnp.asarray(x, jnp.int32)
    if sliding_window is not None and sliding_window <= 0:
        raise ValueError(f"sliding_window must be positive, got {sliding_window}")
    if soft_cap is not None and soft_cap <= 0:
        raise ValueError(f"soft_cap must be positive, got {soft_cap}")
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((T, N, H), q.dtype))
    return call(
        q,
        k_pages,
        v_pages,
        i32(kv_lens),
        i32(page_indices),
        i32(cu_q_lens),
        i32(num_seqs).reshape(-1)[:1],
        k_scales,
        v_scales,
        sm_scale=np.float32(H**-0.5 if sm_scale is None else sm_scale),
        soft_cap=np.float32(0.0 if soft_cap is None else soft_cap),
        sliding_window=np.int32(0 if sliding_window is None else sliding_window),
        num_threads=np.int32(default_num_threads() if num_threads is None else num_threads),
        rows=np.int32(ROWS[rows]),
    )


def cpu_decode_attention(*args, **kwargs):
    """`cpu_ragged_attention` with rows="decode": the decode sequences' rows filled, zeros elsewhere."""
    return cpu_ragged_attention(*args, rows="decode", **kwargs)


# A step program saved to disk by an earlier process may call the kernel without this process tracing it:
# register an already-built library now (cheap; never compiles at import).
_ensure(build=False)
