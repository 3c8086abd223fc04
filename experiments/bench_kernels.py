"""Times the paged-attention kernels and their references on a table of shapes.

Reports the median of --repeats timed runs (after one warm-up that compiles),
the achieved bandwidth (KV bytes the op must read / time), that bandwidth as a
fraction of a device copy measured at the start of the run (y = x + 1 over
--copy_mib MiB: bytes read + written / time, the practical ceiling here) and,
on a known accelerator, as a fraction of the chip's datasheet peak.

On CPU only the references run: a compiled Pallas kernel does not run on CPU
and interpret mode measures the interpreter, not the kernel.

  python -m experiments.bench_kernels                      # whatever jax runs on
  python -m experiments.bench_kernels --repeats=20 --dtype=float32
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from experiments.accelerator_check import measure_copy
from kernels_pallas.paged_attention import paged_attention, reference_paged_attention
from kernels_pallas.ragged_paged_attention import ragged_paged_attention, reference_ragged_paged_attention

_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed runs per case (median).")
_DTYPE = flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "q / KV dtype.")
_PAGE_SIZE = flags.DEFINE_integer("page_size", 16, "Tokens per KV page (G).")
_OPS = flags.DEFINE_list("ops", ["decode", "ragged"], "Which ops to time.")
_CPU_MAX_KV_TOKENS = flags.DEFINE_integer(
    "cpu_max_kv_tokens",
    32 * 2048,
    "On CPU, skip cases whose total context exceeds this many tokens (the "
    "references materialise every gathered context in f32).",
)

_COPY_MIB = flags.DEFINE_integer(
    "copy_mib", 1024, "Array size of the device copy measured at the start (MiB; 256 on CPU is plenty)."
)

# Datasheet peak HBM bandwidth in bytes/s by device_kind substring. What a copy achieves is measured at run time
# (measure_copy), never taken from here.
_PEAK_BW = {
    "H200": 4.8e12,
    "H100": 3.35e12,
    "TPU v5 lite": 819e9,
    "TPU v5e": 819e9,
    "TPU v6 lite": 1640e9,
    "TPU v5p": 2765e9,
    "TPU v4": 1228e9,
}


@dataclasses.dataclass(frozen=True)
class Case:
    op: str  # "decode" | "ragged"
    kv_lens: tuple[int, ...]
    q_lens: tuple[int, ...]  # ragged only
    num_tokens: int  # ragged only: the token bucket T
    num_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 128

    def label(self):
        shape = f"N{self.num_heads} K{self.num_kv_heads} H{self.head_dim}"
        if self.op == "decode":
            return f"decode B={len(self.kv_lens)} ctx={max(self.kv_lens)} {shape}"
        prefill = sum(q > 1 for q in self.q_lens)
        return f"ragged T={self.num_tokens} seqs={len(self.kv_lens)} ({prefill} prefill chunks) {shape}"


def _cases():
    cases = []
    for batch in (8, 32, 128):
        for ctx in (512, 2048):
            for head_dim in (64, 128):
                cases.append(Case("decode", (ctx,) * batch, (1,) * batch, batch, head_dim=head_dim))
    # A mixed step: 2 prefill chunks of 64 tokens (context 256) riding along
    # with 30 decodes (context 512), padded to a 256-token bucket.
    cases.append(Case("ragged", (256,) * 2 + (512,) * 30, (64,) * 2 + (1,) * 30, 256, head_dim=64))
    # A heavier one for accelerators: 4 x 256-token chunks + 124 decodes at 2k.
    cases.append(Case("ragged", (1024,) * 4 + (2048,) * 124, (256,) * 4 + (1,) * 124, 2048, head_dim=128))
    return cases


def _inputs(case: Case, page_size: int, dtype, rng: np.random.Generator):
    num_seqs = len(case.kv_lens)
    pages_per_seq = -(-max(case.kv_lens) // page_size)
    num_pages = num_seqs * pages_per_seq
    shape = (case.num_kv_heads, num_pages, page_size, case.head_dim)
    k_pages = jnp.asarray(rng.standard_normal(shape), dtype)
    v_pages = jnp.asarray(rng.standard_normal(shape), dtype)
    page_indices = jnp.asarray(rng.permutation(num_pages).reshape(num_seqs, pages_per_seq), jnp.int32)
    kv_lens = jnp.asarray(case.kv_lens, jnp.int32)
    rows = num_seqs if case.op == "decode" else case.num_tokens
    q = jnp.asarray(rng.standard_normal((rows, case.num_heads, case.head_dim)), dtype)
    if case.op == "decode":
        return (q, k_pages, v_pages, kv_lens, page_indices)
    cu_q_lens = jnp.asarray(np.concatenate([[0], np.cumsum(case.q_lens)]), jnp.int32)
    return (q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, jnp.asarray([num_seqs], jnp.int32))


def _kv_bytes(case: Case, dtype) -> int:
    # K and V of every live context token, every kv head: what any exact
    # implementation has to read at least once.
    return 2 * sum(case.kv_lens) * case.num_kv_heads * case.head_dim * jnp.dtype(dtype).itemsize


def _median_seconds(fn, args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))  # compile + warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _peak(device_kind: str) -> float | None:
    for key, value in _PEAK_BW.items():
        if key.lower() in device_kind.lower():
            return value
    return None


def main(argv):
    del argv
    backend = jax.default_backend()
    device_kind = jax.devices()[0].device_kind
    peak = _peak(device_kind)
    dtype = jnp.dtype(_DTYPE.value)
    print(
        f"backend={backend} device={device_kind} dtype={dtype.name} "
        f"page_size={_PAGE_SIZE.value} repeats={_REPEATS.value}"
    )
    copy = measure_copy(_COPY_MIB.value << 20, _REPEATS.value)
    copy_bw = copy["bytes_per_s"]
    print(
        f"measured copy {copy_bw / 1e9:.1f} GB/s (y = x + 1 over {copy['array_bytes'] >> 20} MiB, read + written, "
        f"median of {_REPEATS.value})" + (f"; datasheet peak {peak / 1e9:.0f} GB/s" if peak else "")
    )
    if backend == "cpu":
        print("CPU: timing the references only (Pallas kernels need TPU/GPU).")

    impls = {
        "decode": {"kernel": paged_attention, "reference": reference_paged_attention},
        "ragged": {"kernel": ragged_paged_attention, "reference": reference_ragged_paged_attention},
    }
    header = f"{'case':<52} {'impl':<9} {'ms':>9} {'GB/s':>8} {'%copy':>6} {'%peak':>6}"
    print(header)
    print("-" * len(header))
    rng = np.random.default_rng(0)
    for case in _cases():
        if case.op not in _OPS.value:
            continue
        if backend == "cpu" and sum(case.kv_lens) > _CPU_MAX_KV_TOKENS.value:
            print(f"{case.label():<52} skipped on CPU (--cpu_max_kv_tokens)")
            continue
        args = _inputs(case, _PAGE_SIZE.value, dtype, rng)
        kv_bytes = _kv_bytes(case, dtype)
        for name, fn in impls[case.op].items():
            if name == "kernel" and backend == "cpu":
                continue
            seconds = _median_seconds(jax.jit(fn), args, _REPEATS.value)
            bandwidth = kv_bytes / seconds
            of_peak = f"{100 * bandwidth / peak:5.1f}" if peak else "    -"
            of_copy = f"{100 * bandwidth / copy_bw:5.1f}"
            print(f"{case.label():<52} {name:<9} {seconds * 1e3:9.3f} {bandwidth / 1e9:8.2f} {of_copy:>6} {of_peak:>6}")


if __name__ == "__main__":
    app.run(main)
