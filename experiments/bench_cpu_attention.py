"""Attention on CPU, one layer: the XLA loops of xla_attention.py vs the C++ FFI kernel (cpu/attention.py).

Decode cases (--seqs x --ctx): S sequences, each with one query token and a context of `ctx` tokens. Prefill
cases (--prefill): `BxQ` is B fresh prompts of Q tokens, `BxQ@C` B chunks of Q tokens after C tokens of earlier
context. Contexts sit in randomly placed pages. Variants, timed interleaved (one call of each per round; medians
over the rounds):
  xla      xla_ragged_paged_attention with both halves on the XLA loops (the path without a compiler)
  before   decode rows on the kernel, prefill rows on the XLA loop: the CPU default before the prefill kernel
  ffi      both halves on the kernel (one call): the CPU default now
  ffi_t1   the kernel alone, calling thread only
  ffi_t2   the kernel alone, calling thread + 1 helper from XLA's intra-op pool
  dots_t1, dots_t2   ffi_t1, ffi_t2 with bf16_dots (bf16 pages: decode rows by AVX512-BF16's vdpbf16ps, q and the
           softmax weights rounded to bf16; elsewhere the same kernel as ffi_*)
Prints one JSON line per (case, variant): median ms, and GB/s of K+V read (2 * S * ctx * K * H * itemsize /
time) for decode, GFLOP/s (4 * N * H * visible (query, key) pairs / time) for prefill.

  PYTHONPATH=. JAX_PLATFORMS=cpu python -m experiments.bench_cpu_attention
  ... --shapes=llama-small --seqs=64 --ctx=256 --prefill= --rounds=7 --dtype=bfloat16
  ... --seqs= --prefill=1x2048,8x256,1x256@768      (prefill only)

--out FILE also writes a data file for the docs (cbjax/bench/doc_data.py): one run per (case, variant, round),
labelled with the kernel build (`auto.build_kind()`: "avx512", or "portable" under CBJAX_CPU_BUILD=no-avx512 or
on a CPU without AVX-512) and XLA's instruction-set cap (XLA_FLAGS=--xla_cpu_max_isa=AVX2 holds XLA to what such a
CPU has); docs/kernels.md, "CPUs without AVX-512", shows it.
"""

import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from kernels_pallas.cpu import attention as cpu_attention
from kernels_pallas.cpu import auto
from kernels_pallas.xla_attention import xla_ragged_paged_attention

SHAPES = {  # (N query heads, K kv heads, H head dim), as in cbjax/model/config.py
    "llama-tiny": (8, 2, 32),
    "llama-small": (16, 4, 64),
}

_SHAPES = flags.DEFINE_list("shapes", list(SHAPES), "model shapes to time")
_SEQS = flags.DEFINE_list("seqs", ["16", "64", "256"], "decode sequences per step")
_CTX = flags.DEFINE_list("ctx", ["256", "1024"], "context length of every sequence")
_PREFILL = flags.DEFINE_list("prefill", ["1x2048", "8x256", "1x256@768"], "prefill cases: BxQ or BxQ@C")
_VARIANTS = flags.DEFINE_list("variants", ["before", "ffi", "ffi_t1", "ffi_t2"], "what to time")
_ROUNDS = flags.DEFINE_integer("rounds", 5, "timed rounds (one call of each variant per round)")
_PAGE_SIZE = flags.DEFINE_integer("page_size", 16, "tokens per page (G)")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "q / KV dtype")
_SEED = flags.DEFINE_integer("seed", 0, "random data and page placement")
_OUT = flags.DEFINE_string("out", None, "also write every round's time to this data file (docs/data/*.json)")


def xla_max_isa() -> str | None:
    """The --xla_cpu_max_isa of XLA_FLAGS, if set (XLA's own code generation held to that instruction set)."""
    for part in os.environ.get("XLA_FLAGS", "").split():
        if part.startswith("--xla_cpu_max_isa="):
            return part.split("=", 1)[1]
    return None


def make_step(S, ctx, N, K, H, G, dtype, rng, q_len=1):
    """S sequences of q_len new tokens each at the end of a ctx-token context."""
    W = -(-ctx // G)
    P = S * W + 1
    k_pages = rng.standard_normal((K, P, G, H), np.float32)
    v_pages = rng.standard_normal((K, P, G, H), np.float32)
    page_indices = rng.permutation(P)[: S * W].reshape(S, W).astype(np.int32)
    q = rng.standard_normal((S * q_len, N, H), np.float32)
    kv_lens = np.full(S, ctx, np.int32)
    cu_q_lens = np.arange(S + 1, dtype=np.int32) * q_len
    num_seqs = np.array([S], np.int32)
    q, k_pages, v_pages = (jnp.asarray(x, dtype) for x in (q, k_pages, v_pages))
    return q, k_pages, v_pages, *(jnp.asarray(x) for x in (kv_lens, page_indices, cu_q_lens, num_seqs))


def variants():
    full = lambda d, p: jax.jit(lambda *a: xla_ragged_paged_attention(*a, decode_impl=d, prefill_impl=p))
    kernel = lambda n, dots=False: jax.jit(
        lambda *a: cpu_attention.cpu_ragged_attention(*a, num_threads=n, bf16_dots=dots)
    )
    table = {
        "xla": full("xla", "xla"),
        "before": full("ffi", "xla"),
        "ffi": full("ffi", "ffi"),
        "ffi_t1": kernel(1),
        "ffi_t2": kernel(2),
        "dots_t1": kernel(1, True),
        "dots_t2": kernel(2, True),
    }
    return {name: table[name] for name in _VARIANTS.value}


def cases(N, K, H, itemsize):
    """(description, (S, ctx, q_len), work, unit) per case: work / seconds / 1e9 is the reported rate."""
    for S in map(int, _SEQS.value):
        for ctx in map(int, _CTX.value):
            yield dict(seqs=S, ctx=ctx), (S, ctx, 1), 2 * S * ctx * K * H * itemsize, "gb_s"
    for spec in _PREFILL.value:
        head, _, before = spec.partition("@")
        B, Q = map(int, head.split("x"))
        C = int(before or 0)
        pairs = B * sum(C + j + 1 for j in range(Q))  # causal (query, key) pairs
        yield dict(prefill=spec), (B, C + Q, Q), 4 * N * H * pairs, "gflop_s"


def main(argv):
    del argv
    if not cpu_attention.available():
        raise SystemExit(f"FFI kernel unavailable: {cpu_attention.unavailable_reason()}")
    fns = variants()
    rng = np.random.default_rng(_SEED.value)
    dtype = jnp.dtype(_DTYPE.value)
    labels = dict(build=auto.build_kind(), xla_max_isa=xla_max_isa(), dtype=dtype.name)
    load_before = os.getloadavg()[0]
    runs = []
    for shape in _SHAPES.value:
        N, K, H = SHAPES[shape]
        for desc, (S, ctx, q_len), work, unit in cases(N, K, H, dtype.itemsize):
            args = make_step(S, ctx, N, K, H, _PAGE_SIZE.value, dtype, rng, q_len)
            for f in fns.values():  # compile and warm up
                f(*args).block_until_ready()
            times = {name: [] for name in fns}
            for _ in range(_ROUNDS.value):
                for name, f in fns.items():
                    t0 = time.perf_counter()
                    f(*args).block_until_ready()
                    times[name].append(time.perf_counter() - t0)
            base = next((statistics.median(times[b]) for b in ("before", "xla") if b in times), None)
            for name, ts in times.items():
                med = statistics.median(ts)
                row = dict(
                    shapes=shape,
                    dtype=dtype.name,
                    **desc,
                    variant=name,
                    ms=round(med * 1e3, 3),
                    **{unit: round(work / med / 1e9, 2)},
                    speedup=None if base is None else round(base / med, 2),  # vs "before" (else "xla")
                    rounds=len(ts),
                    round_ms=[round(t * 1e3, 2) for t in ts],
                )
                print(json.dumps(row), flush=True)
                case = f"decode {S}x{ctx}" if "seqs" in desc else f"prefill {desc['prefill']}"
                runs += [dict(labels, shapes=shape, case=case, variant=name, round=i + 1, ms=t * 1e3)
                         for i, t in enumerate(ts)]  # fmt: skip
    if _OUT.value:
        from cbjax.bench.doc_data import write_doc_data

        command = " ".join(f"{k}={os.environ[k]}" for k in ("CBJAX_CPU_BUILD", "XLA_FLAGS") if os.environ.get(k))
        write_doc_data(
            _OUT.value,
            command=f"{command} python -m experiments.bench_cpu_attention {' '.join(sys.argv[1:])}".strip(),
            runs=runs,
            what="one attention layer: the C++ kernel against XLA's loops, interleaved rounds",
            settings=dict(labels, page_size=_PAGE_SIZE.value, seed=_SEED.value),
            load_average_before=load_before,
            load_average_after=os.getloadavg()[0],
        )


if __name__ == "__main__":
    app.run(main)
