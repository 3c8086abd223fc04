"""Where a step's time goes, per token bucket: matmuls, attention, LM head, sampling and host packing, and the
step's achieved GFLOP/s against a bare matmul of the same shape measured in the same sitting.

  python -m experiments.profile_step --model llama-small [--matmul_dtype bfloat16] [--kv_cache_dtype bfloat16]
      [--cpu_matmul xla] [--rounds 5]

Each step is synthetic and packed by the engine's own pack_step: `prefill:T` (prompts of min(T, 512) tokens filling
the T-token bucket), `decode:B:C` (B sequences decoding one token at context C), `mixed:T:B:C` (B decodes plus one
prefill chunk filling T). The programs below share the runner's parameters, KV cache and the step's inputs, and
are timed round-robin (`--rounds` rounds of 3 calls; medians):
  step       the production step program of the bucket (model, LM head on each sequence's last token, sampler)
  no_attn    the same program built with the paged attention replaced by its query (KV writes kept): in-step
             attention = step - no_attn
  matmuls    the step's linear layers alone (qkv, o, gate_up, down), x num_layers, on random activations
             (with the packed kernel, on the step's real rows only, as the engine)
  attention  the paged attention alone on the step's real metadata and cache, x num_layers
  lm_head    the LM head matmul on the rows the step's head runs on: S = min(T, max_num_seqs), or the first 32
             (head_sample.HEAD_ROWS) when the step's sequences fit there; with the packed kernel the fused
             greedy head the engine runs for an all-greedy step (the argmax of the product, no logits)
  sampling   the sampler on those rows' logits (0 with the packed kernel's fused greedy head)
  other      step - (matmuls + in-step attention + lm_head + sampling): norms, RoPE, KV writes, embedding, glue
  host       pack_step on the host
The linears, `matmuls` and `lm_head` run the engine's matmul: the packed CPU kernel where `--cpu_matmul` (the engine
option, default auto) resolves to it, else XLA's dot.
GFLOP/s = the step's matmul + attention + LM-head FLOPs / step time; `bare` = a lone [T, D] x [D, 2F] matmul (the
step's widest GEMM) on XLA's dot in the same rounds; `vs bare` = their ratio. Prints a markdown table and one JSON
line per step.

--doc_data PATH: also write a data file for the docs (cbjax/bench/doc_data.py) with one run per step and round:
that round's times (ms) and the figures derived from them (in-step attention, other, GFLOP/s, vs bare), so a
table can give each step's medians with their intervals (the view `medians` by `name`).
"""

import json
import os
import statistics
import sys
import time

from absl import app, flags

flags.DEFINE_string("model", "llama-small", "named model config")
flags.DEFINE_list(
    "steps",
    [
        "prefill:256",
        "prefill:1024",
        "prefill:2048",
        "mixed:2048:32:256",
        "decode:16:256",
        "decode:64:256",
        "decode:256:256",
    ],
    "synthetic steps (see the docstring)",
)
flags.DEFINE_integer("max_num_seqs", 256, "slots")
flags.DEFINE_integer("max_model_len", 2048, "page-table width")
flags.DEFINE_integer("rounds", 5, "interleaved timing rounds")
flags.DEFINE_string("matmul_dtype", None, "the linear layers' dtype (ModelConfig.matmul_dtype)")
flags.DEFINE_string("kv_cache_dtype", "auto", "the KV pages' dtype, as the engine option (auto: the model's dtype)")
flags.DEFINE_string("cpu_matmul", "auto", "auto | packed | xla: the linears' matmul, as the engine option")
flags.DEFINE_string("doc_data", None, "also write a data file for the docs: one run per step and round")
FLAGS = flags.FLAGS

PAGE_SIZE = 16


def _seqs(spec: str, max_num_seqs: int) -> tuple[int, list[tuple[int, int]]]:
    """(token bucket, [(new tokens, context after the step)] per sequence)."""
    kind, *nums = spec.split(":")
    n = [int(x) for x in nums]
    if kind == "prefill":
        chunk = min(n[0], 512)
        return n[0], [(chunk, chunk)] * (n[0] // chunk)
    if kind == "decode":
        return n[0], [(1, n[1])] * min(n[0], max_num_seqs)
    if kind == "mixed":
        T, B, C = n
        return T, [(1, C)] * B + [(T - B, T - B)]
    raise ValueError(f"unknown step kind in {spec!r}")


def _runner_without_attention(model, num_pages, buckets):
    """A runner whose step programs skip the paged attention (the attention output is the query itself)."""
    import jax

    import cbjax.model.llama as llama
    from cbjax.runner.compilation.program_family import clear_shared_programs

    real = llama.ragged_attention
    llama.ragged_attention = lambda q, *args, **kwargs: q
    # The programs are keyed by shapes, not by the attention they trace: forget the built ones, and jax's traces
    # of the step (else the real runner would get this trace back, or this runner the real one).
    clear_shared_programs()
    jax.clear_caches()
    try:
        runner = _runner(model, num_pages, buckets)
        runner.warmup("full")
    finally:
        llama.ragged_attention = real
        clear_shared_programs()
        jax.clear_caches()
    return runner


def _runner(model, num_pages, buckets):
    """A runner of `model` with `num_pages` KV pages, on the xla attention backend, no swapping, no speculation."""
    from cbjax.config.cache import CacheConfig
    from cbjax.config.compilation import CompilationConfig
    from cbjax.config.parallel import ParallelConfig
    from cbjax.runner.build import build_model_runner

    return build_model_runner(
        model,
        cache=CacheConfig(
            page_size=PAGE_SIZE, num_pages=num_pages, num_host_pages=0, kv_cache_dtype=FLAGS.kv_cache_dtype
        ),
        compilation=CompilationConfig(attention_backend="xla"),
        parallel=ParallelConfig(),
        speculative=None,
        num_scheduler_steps=1,
        buckets=buckets,
    )


def _median_ms(f, calls: int = 3) -> float:
    import jax

    t0 = time.perf_counter()
    for _ in range(calls):
        jax.block_until_ready(f())
    return 1e3 * (time.perf_counter() - t0) / calls


def derived(t: dict, flops: float, bare_flops: float) -> dict:
    """The columns computed from a set of times (ms): in-step attention, other, GFLOP/s and its ratio to bare."""
    t = dict(t)
    t.setdefault("sampling", 0.0)
    t["in_step_attention"] = t["step"] - t["no_attn"]
    t["other"] = t["no_attn"] - t["matmuls"] - t["lm_head"] - t["sampling"]
    out = {k: round(v, 2) for k, v in t.items()}
    step_gflops, bare_gflops = flops / t["step"] / 1e6, bare_flops / t["bare"] / 1e6
    return out | dict(
        gflops=round(step_gflops, 1), bare_gflops=round(bare_gflops, 1), vs_bare=round(step_gflops / bare_gflops, 2)
    )


def main(argv):
    del argv
    import jax
    import jax.numpy as jnp
    import numpy as np

    from cbjax.core.request import Request
    from cbjax.core.sampling_params import SamplingParams
    from cbjax.core.scheduler_output import ScheduledSeq, SchedulerOutput
    from cbjax.model.config import get_model_config
    from cbjax.model.linear_impl import serving_model
    from cbjax.model.llama import init_model
    from cbjax.model.packed_linear import PackedLinear
    from cbjax.runner.head_sample import HEAD_ROWS
    from cbjax.runner.sampler import sample
    from cbjax.runner.step_input import BucketTable, pack_step
    from kernels_pallas import ragged_attention
    from kernels_pallas.cpu import gemm as cpu_gemm

    cfg = get_model_config(FLAGS.model)
    if FLAGS.matmul_dtype:
        cfg = cfg.replace(matmul_dtype=FLAGS.matmul_dtype)
    D, N, K, H, F, V, L = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.dim_per_head,
                           cfg.intermediate_size, cfg.vocab_size, cfg.num_layers)  # fmt: skip
    mm = jnp.dtype(cfg.matmul_dtype or cfg.dtype)
    # The linears as the engine runs them: packed for the CPU matmul kernel where `cpu_matmul` resolves so.
    model = serving_model(init_model(cfg), None, FLAGS.cpu_matmul)
    packed = isinstance(model.layers[0].mlp.down_proj, PackedLinear)
    specs = [(s, *_seqs(s, FLAGS.max_num_seqs)) for s in FLAGS.steps]
    top = max(T for _, T, _ in specs)
    pages_needed = sum(-(-kv // PAGE_SIZE) for _, _, seqs in specs for _, kv in seqs)
    buckets = BucketTable.build(top, FLAGS.max_model_len, PAGE_SIZE, FLAGS.max_num_seqs)
    runner = _runner(model, pages_needed + 1, buckets)
    no_attn = _runner_without_attention(model, pages_needed + 1, buckets)
    rng = np.random.default_rng(0)
    key = iter(jax.random.split(jax.random.key(0), 64))

    def w(*shape):
        return jax.random.normal(next(key), shape, jnp.float32).astype(mm) * 0.02

    # One weight set per layer, as in the model: the same dots repeated on the same operands would be merged by
    # XLA (common subexpressions), and one set would stay in cache where the model's L sets do not.
    layers = [dict(qkv=w(D, (N + 2 * K) * H), o=w(N * H, D), gate_up=w(D, 2 * F), down=w(F, D)) for _ in range(L)]
    weights = dict(gate_up=layers[0]["gate_up"], head=w(D, V))
    # `bare` stays XLA's dot: the reference peak of a lone matmul of the step's shape.
    xla_dot = dot = jax.jit(lambda x, y: jnp.dot(x.astype(mm), y, preferred_element_type=jnp.float32))
    if packed:  # the linears' and LM head's weights as panels, and their matmul the packed kernel (all N's
        # here are multiples of its 32-column panels, so every panel column is a real one)
        pack = lambda y: jnp.asarray(cpu_gemm.pack_weight(np.asarray(y)))
        layers = [{k: pack(v) for k, v in lw.items()} for lw in layers]
        weights = dict(gate_up=weights["gate_up"], head=pack(weights["head"]))
        # valid_rows: the engine's linears skip a padded batch's padding rows (None: every row).
        # x cast to the weights' dtype, as PackedLinear does (bf16 panels take bf16 x)
        dot = lambda x, y, rows=None: cpu_gemm.packed_matmul(
            x.astype(y.dtype), y, y.shape[0] * cpu_gemm.NR, valid_rows=rows
        )
        dot = jax.jit(dot)

    @jax.jit
    def matmuls(x, a, layers, rows):
        acc = jnp.zeros((), jnp.float32)
        mm_rows = (lambda x, y: dot(x, y, rows)) if packed else dot
        for lw in layers:  # the step's L layers of linears, kept alive through a reduction
            acc += mm_rows(x, lw["qkv"]).sum() + mm_rows(a, lw["o"]).sum()
            acc += mm_rows(jax.nn.silu(mm_rows(x, lw["gate_up"]))[:, :F], lw["down"]).sum()
        return acc

    # With the packed kernel an all-greedy step's head is fused: the LM head's argmax, no logits, no sampler.
    greedy_head = jax.jit(
        lambda h, rows: cpu_gemm.packed_matmul_argmax(h.astype(mm), weights["head"], V, valid_rows=rows)
    )

    @jax.jit
    def attention(q, kv_caches, md):
        out = jnp.zeros((), jnp.float32)
        for kv in kv_caches:  # each layer's own cache (distinct operands: nothing merged)
            out += ragged_attention(q, *kv, *md, backend=runner.backend).astype(jnp.float32).sum()
        return out

    sampler = jax.jit(sample)
    next_page = 0
    rows, runs = [], []
    for spec, T, seqs in specs:
        scheduled = []
        for i, (q_len, kv_len) in enumerate(seqs):
            # Greedy, as in the throughput runs (sampling with temperature draws [S, V] random numbers per step).
            greedy = SamplingParams(temperature=0.0)
            req = Request(f"{spec}-{i}", rng.integers(3, V, kv_len).tolist(), greedy, 0.0, 0, i)
            n_pages = -(-kv_len // PAGE_SIZE)
            req.pages = list(range(next_page, next_page + n_pages))
            next_page += n_pages
            scheduled.append(ScheduledSeq(req, kv_len - q_len, q_len, True))
        out = SchedulerOutput(scheduled, sum(q for q, _ in seqs), [], 0.0)
        host = []
        for _ in range(20):
            t0 = time.perf_counter()
            inp, _ = pack_step(out, buckets, runner.pad_page, {})
            host.append(1e3 * (time.perf_counter() - t0))
        S = inp.sample_idx.shape[0]
        # The step's LM head and sampler run on the first HEAD_ROWS rows when its sequences fit there, else on all S.
        S = HEAD_ROWS if len(seqs) <= HEAD_ROWS < S else S
        x = jax.random.normal(next(key), (T, D), jnp.float32)
        a = jax.random.normal(next(key), (T, N * H), jnp.float32)
        q = jax.random.normal(next(key), (T, N, H), jnp.float32)
        md = tuple(jnp.asarray(v) for v in (inp.kv_lens, inp.page_indices, inp.cu_q_lens, inp.num_seqs))
        hidden = jax.random.normal(next(key), (S, D), jnp.float32)
        logits = dot(hidden, weights["head"])
        params = [jnp.asarray(v)[:S] for v in (inp.temperature, inp.top_k, inp.top_p, inp.seeds, inp.counters)]
        tokens, n = np.int32(sum(q for q, _ in seqs)), np.int32(len(seqs))
        programs = {
            "step": lambda inp=inp: runner.run_input(inp),
            "no_attn": lambda inp=inp: no_attn.run_input(inp),
            "matmuls": lambda x=x, a=a, r=tokens: matmuls(x, a, layers, r),
            "attention": lambda q=q, md=md: attention(q, runner.kv_caches, md),
            "lm_head": lambda h=hidden: dot(h, weights["head"]),
            "sampling": lambda lg=logits, p=params: sampler(lg, *p),
            "bare": lambda x=x: xla_dot(x, weights["gate_up"]),
        }
        if packed:  # the fused greedy head, in the `lm_head` column; nothing left to sample
            programs["lm_head"] = lambda h=hidden, r=n: greedy_head(h, r)
            del programs["sampling"]
        times = {k: [] for k in programs}
        for f in programs.values():  # compile and warm up
            jax.block_until_ready(f())
        for _ in range(FLAGS.rounds):
            for k, f in programs.items():
                times[k].append(_median_ms(f))
        linear_flops = 2 * int(tokens) * L * (D * (N + 2 * K) * H + N * H * D + 2 * D * F + F * D)
        attn_flops = 4 * L * N * H * sum(q * (kv - q) + q * (q + 1) // 2 for q, kv in seqs)
        flops, bare_flops = linear_flops + attn_flops + 2 * len(seqs) * D * V, 2 * T * D * 2 * F
        host_ms = statistics.median(host)
        labels = dict(name=spec, T=T, seqs=len(seqs))
        for i in range(FLAGS.rounds):
            one = derived({k: v[i] for k, v in times.items()}, flops, bare_flops)
            runs.append(labels | {"round": i + 1, **one, "host": round(host_ms, 3)})
        t = {k: statistics.median(v) for k, v in times.items()}
        row = labels | derived(t, flops, bare_flops) | {"host": round(host_ms, 2)}
        row.update(model=FLAGS.model, matmul_dtype=str(mm), packed=packed)
        rows.append(row)
        print(json.dumps(row), flush=True)
    cols = (
        "name",
        "T",
        "step",
        "matmuls",
        "attention",
        "in_step_attention",
        "lm_head",
        "sampling",
        "other",
        "host",
        "gflops",
        "bare_gflops",
    )
    print(
        "\n| step | T | step ms | matmuls | attention alone | attention in step | LM head | sampling | other | host"
        " | GFLOP/s | bare | vs bare |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(str(r[c]) for c in cols) + f" | {r['vs_bare']} |")
    if FLAGS.doc_data:
        from cbjax.bench.doc_data import write_doc_data

        argv = sys.argv[1:]  # the command without --doc_data and its file
        skip = {j for i, a in enumerate(argv) if a == "--doc_data" for j in (i, i + 1)}
        skip |= {i for i, a in enumerate(argv) if a.startswith("--doc_data=")}
        args = [a for i, a in enumerate(argv) if i not in skip]
        what = "per synthetic step, the time (ms) of its parts and its GFLOP/s against a bare matmul, per round"
        write_doc_data(FLAGS.doc_data, command=" ".join(["python -m experiments.profile_step", *args]), runs=runs,
                       what=what, model=FLAGS.model, matmul_dtype=str(mm), packed=packed,
                       load_average=round(os.getloadavg()[0], 2))  # fmt: skip


if __name__ == "__main__":
    app.run(main)
