"""A float32 or bfloat16 matmul for CPU against pre-packed weights: a C++ XLA FFI custom call (gemm.cc), fast at
decode sizes (a few to a few hundred rows).

At small M a matmul is bound by reading its weights. XLA:CPU's dot (Eigen / oneDNN underneath) re-packs the weight
matrix on every call and walks B [K, N] a column block at a time, crossing a page at every k. `pack_weight` lays
the weights out once, at load time, as panels [ceil(N / NR), K, NR]: NR columns contiguous for each k, every panel
one linear stream. `packed_matmul(x, w_packed, n)` then reads each weight once per call.

bfloat16: `pack_weight` of a bf16 matrix gives bf16 panels of k-pairs [ceil(N / NR), ceil(K / 2), NR, 2] (element
[p, kk, j, t] = w[2 kk + t, p NR + j], zeros past K and N), the operand layout of AVX512-BF16's vdpbf16ps; x is
then bf16 too and the products are summed in float32 (output float32), as a bf16 x bf16 -> f32 `jnp.dot`.

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


def is_bf16(w_packed) -> bool:
    """Whether packed weights are the bfloat16 layout [P, ceil(K / 2), NR, 2] (else float32 [P, K, NR])."""
    return jnp.dtype(w_packed.dtype) == jnp.bfloat16


def pack_weight(w) -> np.ndarray:
    """w [K, N] float32 -> panels [ceil(N / NR), K, NR] float32; panel p holds columns p*NR .. p*NR + NR - 1 (zeros
    past N). w bfloat16 -> bf16 panels of k-pairs [ceil(N / NR), ceil(K / 2), NR, 2] (zeros past K and N; see the
    module docstring). Runs on the host, once per weight, at load time."""
    w = np.asarray(w)
    if w.ndim != 2 or w.dtype not in (np.float32, jnp.bfloat16):
        raise ValueError(f"pack_weight expects a float32 or bfloat16 [K, N] matrix, got {w.dtype} {w.shape}")
    K, N = w.shape
    P = num_panels(N)
    if w.dtype == np.float32:
        padded = np.zeros((K, P * NR), np.float32)
        padded[:, :N] = w
        return np.ascontiguousarray(padded.reshape(K, P, NR).transpose(1, 0, 2))
    Kh = -(-K // 2)
    padded = np.zeros((2 * Kh, P * NR), w.dtype)
    padded[:K, :N] = w
    # [2 Kh, P NR] -> [Kh, 2, P, NR] -> [P, Kh, NR, 2]
    return np.ascontiguousarray(padded.reshape(Kh, 2, P, NR).transpose(2, 0, 3, 1))


def unpack_weight(w_packed, n: int, k: int | None = None):
    """The inverse of `pack_weight`: [P, K, NR] -> [K, n], or bf16 [P, Kh, NR, 2] -> [k, n] (k: the original K,
    2 Kh - 1 or 2 Kh; default 2 Kh) (jnp; works on traced arrays)."""
    if is_bf16(w_packed):
        P, Kh, nr, _ = w_packed.shape
        full = jnp.transpose(w_packed, (1, 3, 0, 2)).reshape(2 * Kh, P * nr)
        return full[: 2 * Kh if k is None else k, :n]
    P, K, nr = w_packed.shape
    return jnp.transpose(w_packed, (1, 0, 2)).reshape(K, P * nr)[:, :n]


def _check(x, w_packed, n: int):
    if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 0:
        raise ValueError(f"n must be a non-negative int (static), got {n!r}")
    if is_bf16(w_packed):
        if x.dtype != jnp.bfloat16:
            raise ValueError(f"packed_matmul with bfloat16 weights takes bfloat16 x, got {x.dtype}")
        if x.ndim < 1 or w_packed.ndim != 4 or w_packed.shape[2:] != (NR, 2):
            raise ValueError(
                f"expected x [..., K] and packed bf16 weights [P, ceil(K / 2), {NR}, 2], got {x.shape} and "
                f"{w_packed.shape}"
            )
        P, Kh = w_packed.shape[:2]
        if -(-x.shape[-1] // 2) != Kh:
            raise ValueError(f"x's last dim {x.shape[-1]} does not fit the packed bf16 weights' ceil(K / 2) = {Kh}")
    else:
        if x.dtype != jnp.float32 or w_packed.dtype != jnp.float32:
            raise ValueError(
                f"packed_matmul takes float32 (or bfloat16) x and weights, got {x.dtype} and {w_packed.dtype}"
            )
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
    target = library.gemm_target(argmax=argmax, bf16=is_bf16(w_packed))
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
    """x [..., K] float32 @ the [K, n] matrix packed as w_packed [ceil(n / NR), K, NR] -> [..., n] float32 (or x
    bfloat16 and the bf16 panels [ceil(n / NR), ceil(K / 2), NR, 2]: float32 sums of the bf16 products).
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
    """`packed_matmul` in plain jnp (unpack, then a dot at full precision into float32): the tests' oracle."""
    x, w_packed = jnp.asarray(x), jnp.asarray(w_packed)
    _check(x, w_packed, n)
    w = unpack_weight(w_packed, n, x.shape[-1])
    y = jnp.dot(x, w, precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    if valid_rows is None:
        return y
    flat = y.reshape(-1, n)
    keep = jnp.arange(flat.shape[0]) < jnp.asarray(valid_rows, jnp.int32).reshape(())
    return jnp.where(keep[:, None], flat, 0.0).reshape(y.shape)
