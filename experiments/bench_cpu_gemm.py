"""Matmuls on CPU at decode sizes: XLA's `jnp.dot` vs the packed-weight FFI kernel (kernels_pallas/cpu/gemm.py).

Two kinds of case, each timed interleaved (one call of each variant per round; medians over the rounds):
  standalone  y = x @ w for one weight [K, N] (--shapes, KxN; llama-small's: qkv 1024x1536, o 1024x1024,
              gate|up 1024x5632, down 2816x1024, LM head 1024x32000), called again and again: the weight may
              stay in the last-level cache between calls, which flatters both variants.
  chain       an 8-layer MLP stack like llama-small's (--chain_layers x (gate|up [D, 2F], silu(gate) * up,
              down [F, D], residual add)), distinct weights per layer, in one jitted program: 8 x 34.6 MB of
              weights per call, as in a real decode step, so no weight is hot in cache when it is read.
              --qkv=1536 adds llama-small's attention projections to each layer (qkv [D, 1536], o [D, D]).
Variants: xla (`jnp.dot`, float32, under jit) and packed (`packed_matmul`, weights packed once outside the timed
call). --dtype=bfloat16: bf16 weights, x cast to bf16 at each matmul and float32 sums on both sides (XLA's
`jnp.dot(..., preferred_element_type=float32)` as a model with matmul_dtype bfloat16 runs it; the packed kernel's
bf16 panels); activations between the chain's layers stay float32, as in the model. Prints one JSON line per
(case, M): median ms, GFLOP/s (2 M K N / time, summed over the chain's matmuls) and packed's speedup over xla.

  PYTHONPATH=. JAX_PLATFORMS=cpu python -m experiments.bench_cpu_gemm
  ... --ms=256,512,1024,2048 --shapes=1024x5632,2816x1024 --chain_ms=   (where XLA catches up)

--out FILE also writes a data file for the docs (cbjax/bench/doc_data.py): one run per (case, M, variant, round),
labelled with the kernel build and XLA's instruction-set cap, as experiments/bench_cpu_attention.py's.
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

from kernels_pallas.cpu import auto
from kernels_pallas.cpu import gemm as cpu_gemm

_SHAPES = flags.DEFINE_list("shapes", ["1024x1536", "1024x1024", "1024x5632", "2816x1024", "1024x32000"], "KxN weights")
_MS = flags.DEFINE_list("ms", ["16", "64", "256"], "rows (M) for the standalone cases")
_CHAIN_MS = flags.DEFINE_list("chain_ms", ["16", "64", "256"], "rows (M) for the chain cases")
_CHAIN_LAYERS = flags.DEFINE_integer("chain_layers", 8, "MLP layers in the chain")
_D = flags.DEFINE_integer("d", 1024, "hidden size of the chain")
_F = flags.DEFINE_integer("f", 2816, "intermediate size of the chain")
_QKV = flags.DEFINE_integer(
    "qkv", 0, "also an attention block per layer: qkv [D, qkv], its first D columns (attention's stand-in), o [D, D]"
)
_ROUNDS = flags.DEFINE_integer("rounds", 7, "timed rounds (one call of each variant per round)")
_THREADS = flags.DEFINE_integer("num_threads", 0, "packed kernel threads (0: this process's CPUs)")
_SEED = flags.DEFINE_integer("seed", 0, "random data")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "the weights' and matmul inputs' dtype")
_OUT = flags.DEFINE_string("out", None, "also write every round's time to this data file (docs/data/*.json)")
RUNS: list[dict] = []  # every round of every case, for --out


def xla_max_isa() -> str | None:
    """The --xla_cpu_max_isa of XLA_FLAGS, if set (as bench_cpu_attention.py's; importing it would define its
    flags twice)."""
    flags_ = os.environ.get("XLA_FLAGS", "").split()
    return next((f.split("=", 1)[1] for f in flags_ if f.startswith("--xla_cpu_max_isa=")), None)


def interleaved(fns: dict, args: dict, rounds: int, case: dict) -> dict:
    """Median seconds per variant, one call of each per round after a warm-up call that compiles; every round's
    time goes to RUNS, labelled with `case`."""
    for name, f in fns.items():
        jax.block_until_ready(f(*args[name]))
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, f in fns.items():
            t0 = time.perf_counter()
            jax.block_until_ready(f(*args[name]))
            times[name].append(time.perf_counter() - t0)
    for name, ts in times.items():
        RUNS.extend(dict(case, variant=name, round=i + 1, ms=t * 1e3) for i, t in enumerate(ts))
    return {name: statistics.median(ts) for name, ts in times.items()}


def report(case: dict, flops: float, med: dict) -> None:
    row = dict(case)
    for name, t in med.items():
        row[f"{name}_ms"] = round(t * 1e3, 3)
        row[f"{name}_gflop_s"] = round(flops / t / 1e9, 1)
    row["speedup"] = round(med["xla"] / med["packed"], 2)
    print(json.dumps(row), flush=True)


def xla_dot(x, w):
    """x @ w as the model's linears run it: x cast to the weights' dtype, float32 sums."""
    return jnp.dot(x.astype(w.dtype), w, preferred_element_type=jnp.float32)


def packed_dot(x, wp, n, threads):
    return cpu_gemm.packed_matmul(x.astype(wp.dtype), wp, n, num_threads=threads)


def weight(rng, shape):
    return (rng.standard_normal(shape, np.float32) * 0.02).astype(jnp.dtype(_DTYPE.value))


def standalone(rng, threads):
    xla = jax.jit(xla_dot)
    for shape in _SHAPES.value:
        K, N = map(int, shape.split("x"))
        w = weight(rng, (K, N))
        wp = jnp.asarray(cpu_gemm.pack_weight(w))
        w = jnp.asarray(w)
        packed = jax.jit(lambda x, wp, n=N: packed_dot(x, wp, n, threads))
        for M in map(int, _MS.value):
            x = jnp.asarray(rng.standard_normal((M, K), np.float32))
            case = dict(case="standalone", shape=shape, m=M)
            med = interleaved({"xla": xla, "packed": packed}, {"xla": (x, w), "packed": (x, wp)}, _ROUNDS.value, case)
            report(case, 2.0 * M * K * N, med)


def chain(rng, threads):
    D, F, L, Q = _D.value, _F.value, _CHAIN_LAYERS.value, _QKV.value
    shapes = [(D, 2 * F), (F, D)] + ([(D, Q), (D, D)] if Q else [])  # gate|up, down (, qkv, o)
    plain, packs = [], []
    for _ in range(L):
        ws = [weight(rng, s) for s in shapes]
        plain.append([jnp.asarray(w) for w in ws])
        packs.append([jnp.asarray(cpu_gemm.pack_weight(w)) for w in ws])

    def stack(matmul):
        def run(x, layers):
            for ws in layers:
                if Q:
                    x = x + matmul(matmul(x, ws[2], Q)[:, :D], ws[3], D)
                gate, u = jnp.split(matmul(x, ws[0], 2 * F), 2, axis=-1)
                x = x + matmul(jax.nn.silu(gate) * u, ws[1], D)
            return x

        return jax.jit(run)

    xla = stack(lambda x, w, n: xla_dot(x, w))
    packed = stack(lambda x, w, n: packed_dot(x, w, n, threads))
    for M in map(int, _CHAIN_MS.value):
        x = jnp.asarray(rng.standard_normal((M, D), np.float32))
        case = dict(case="chain", shape=f"{L} layers {D}x{2 * F}, {F}x{D}" + (f", {D}x{Q}, {D}x{D}" if Q else ""), m=M)
        fns, fn_args = {"xla": xla, "packed": packed}, {"xla": (x, plain), "packed": (x, packs)}
        med = interleaved(fns, fn_args, _ROUNDS.value, case)
        flops = 2.0 * M * L * sum(k * n for k, n in shapes)
        report(dict(case="chain", layers=L, d=D, f=F, qkv=Q, m=M), flops, med)


def main(argv):
    del argv
    if not cpu_gemm.available():
        raise SystemExit(f"packed matmul kernel unavailable: {cpu_gemm.unavailable_reason()}")
    rng = np.random.default_rng(_SEED.value)
    threads = _THREADS.value or None
    if _MS.value:
        standalone(rng, threads)
    if _CHAIN_MS.value:
        chain(rng, threads)
    if _OUT.value:
        from cbjax.bench.doc_data import write_doc_data

        labels = dict(build=auto.build_kind(), xla_max_isa=xla_max_isa(), dtype=_DTYPE.value)
        command = " ".join(f"{k}={os.environ[k]}" for k in ("CBJAX_CPU_BUILD", "XLA_FLAGS") if os.environ.get(k))
        write_doc_data(
            _OUT.value,
            command=f"{command} python -m experiments.bench_cpu_gemm {' '.join(sys.argv[1:])}".strip(),
            runs=[dict(labels, **r) for r in RUNS],
            what=f"{_DTYPE.value} matmuls at decode sizes: the packed C++ kernel against XLA's dot, interleaved rounds",
            settings=dict(labels, num_threads=_THREADS.value, seed=_SEED.value),
        )


if __name__ == "__main__":
    app.run(main)
