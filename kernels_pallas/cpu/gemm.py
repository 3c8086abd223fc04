"""A float32 matmul for CPU against pre-packed weights: a C++ XLA FFI custom call (gemm.cc), fast at decode
sizes (a few to a few hundred rows).

At small M a matmul is bound by reading its weights. XLA:CPU's dot (Eigen / oneDNN underneath) re-packs the weight
matrix on every call and walks B [K, N] a column block at a time, crossing a page at every k. `pack_weight` lays
the weights out once, at load time, as panels [ceil(N / NR), K, NR]: NR columns contiguous for each k, every panel
one linear stream. `packed_matmul(x, w_packed, n)` then reads each weight once per call.

Every output element is summed in the same order (k = 0 .. K-1, one fused multiply-add chain) whatever M, the
thread count, or where its row sits in the batch: a row's result is bitwise the same alone or in any batch.

The kernel lives in the same shared library as the CPU attention kernels (library.py builds, caches and
registers it); `available()` is False without a C++ compiler, and callers keep `jnp.dot` then.
"""

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.cpu import library

NR = 32  # columns per panel: two AVX-512 registers (gemm.cc's kNR)


def available() -> bool:
    """True if the kernel is built (building it now if needed) and registered in this process."""
    return library.gemm_target() is not None


def unavailable_reason() -> str | None:
    """Why `available()` is False (None if it is True or was not asked yet)."""
    return library.unavailable_reason()


def num_panels(n: int) -> int:
    return -(-n // NR)


def pack_weight(w) -> np.ndarray:
    """w [K, N] float32 -> panels [ceil(N / NR), K, NR] float32; panel p holds columns p*NR .. p*NR + NR - 1 (zeros
    past N). Runs on the host, once per weight, at load time."""
    w = np.asarray(w)
    if w.ndim != 2 or w.dtype != np.float32:
        raise ValueError(f"pack_weight expects a float32 [K, N] matrix, got {w.dtype} {w.shape}")
    K, N = w.shape
    P = num_panels(N)
    padded = np.zeros((K, P * NR), np.float32)
    padded[:, :N] = w
    return np.ascontiguousarray(padded.reshape(K, P, NR).transpose(1, 0, 2))


def unpack_weight(w_packed, n: int):
    """The inverse of `pack_weight`: [P, K, NR] -> [K, n] (jnp; works on traced arrays)."""
    P, K, nr = w_packed.shape
    return jnp.transpose(w_packed, (1, 0, 2)).reshape(K, P * nr)[:, :n]


def _check(x, w_packed, n: int):
    if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 0:
        raise ValueError(f"n must be a non-negative int (static), got {n!r}")
    if x.dtype != jnp.float32 or w_packed.dtype != jnp.float32:
        raise ValueError(f"packed_matmul takes float32 x and weights, got {x.dtype} and {w_packed.dtype}")
    if x.ndim < 1 or w_packed.ndim != 3 or w_packed.shape[2] != NR:
        raise ValueError(f"expected x [..., K] and packed weights [P, K, {NR}], got {x.shape} and {w_packed.shape}")
    P, K, _ = w_packed.shape
    if x.shape[-1] != K:
        raise ValueError(f"x's last dim {x.shape[-1]} differs from the packed weights' K = {K}")
    if num_panels(n) != P:
        raise ValueError(f"packed weights have {P} panels, n = {n} needs ceil(n / {NR}) = {num_panels(n)}")


def _call(x, w_packed, n: int, num_threads: int | None, valid_rows, argmax: bool):
    """The FFI call both entry points make: x [..., K] -> [..., n] float32 products, or with `argmax` [...] int32."""
    x, w_packed = jnp.asarray(x), jnp.asarray(w_packed)
    _check(x, w_packed, n)
    if argmax and n == 0:
        raise ValueError("packed_matmul_argmax needs n >= 1 columns")
    target = library.gemm_target(argmax=argmax)
    if target is None:
        raise RuntimeError(f"the CPU packed matmul kernel is unavailable: {unavailable_reason()}")
    lead, K = x.shape[:-1], x.shape[-1]
    M = int(np.prod(lead, dtype=np.int64))
    out = jax.ShapeDtypeStruct((M,), jnp.int32) if argmax else jax.ShapeDtypeStruct((M, n), jnp.float32)
    threads = library.default_num_threads() if num_threads is None else num_threads
    rows = jnp.full((1,), M, jnp.int32) if valid_rows is None else jnp.asarray(valid_rows, jnp.int32).reshape(1)
    y = jax.ffi.ffi_call(target, out)(x.reshape(M, K), w_packed, rows, n=np.int64(n), num_threads=np.int32(threads))
    return y.reshape(lead) if argmax else y.reshape(*lead, n)


def packed_matmul(x, w_packed, n: int, num_threads: int | None = None, valid_rows=None):
    """x [..., K] float32 @ the [K, n] matrix packed as w_packed [ceil(n / NR), K, NR] -> [..., n] float32.
    `num_threads` (default: this process's CPUs) caps the threads the kernel uses (1: the calling thread only);
    the result does not depend on it. `valid_rows` (an int32 scalar or [1] array, may be traced): the rows of x
    (flattened over its leading dims) from valid_rows on are padding: their outputs are zeros and cost nothing;
    None: every row is computed. Jittable; CPU backend only. RuntimeError if the kernel is unavailable."""
    return _call(x, w_packed, n, num_threads, valid_rows, argmax=False)


def packed_matmul_argmax(x, w_packed, n: int, num_threads: int | None = None, valid_rows=None):
    """argmax over the last axis of packed_matmul(x, w_packed, n) without materialising it: x [..., K] -> int32
    [...]. The product's values are packed_matmul's, bit for bit; the pick is jnp.argmax's (the first NaN, else
    the first column of the largest value). Rows from `valid_rows` on get 0. The greedy LM head: it saves
    writing and re-reading the [rows, vocab] logits."""
    return _call(x, w_packed, n, num_threads, valid_rows, argmax=True)


def reference_packed_matmul(x, w_packed, n: int, valid_rows=None):
    """`packed_matmul` in plain jnp (unpack, then a float32 dot at full precision): the tests' oracle."""
    x, w_packed = jnp.asarray(x), jnp.asarray(w_packed)
    _check(x, w_packed, n)
    y = jnp.dot(x, unpack_weight(w_packed, n), precision=jax.lax.Precision.HIGHEST)
    if valid_rows is None:
        return y
    flat = y.reshape(-1, n)
    keep = jnp.arange(flat.shape[0]) < jnp.asarray(valid_rows, jnp.int32).reshape(())
    return jnp.where(keep[:, None], flat, 0.0).reshape(y.shape)
