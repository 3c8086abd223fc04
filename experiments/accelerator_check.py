"""The accelerator check: one command that checks and measures cbjax on whatever jax backend is present.

  python -m experiments.accelerator_check                        # full size on TPU/GPU, small on CPU
  python -m experiments.accelerator_check --size=small --output=/tmp/check.json --skip=throughput

What runs at each size (the cases, models and workloads) is experiments/accelerator_plans.py.

Sections (each timed, each with a status, its figures and any error; one failing never stops the others):
- kernels (correctness): the Pallas kernels of kernels_pallas/ (decode `paged_attention`, mixed
  `ragged_paged_attention`, both on float and int8 pages) against their pure-jnp `reference_*`, on poisoned caches
  (NaN in every page and row no sequence owns, garbage page-table entries past each sequence's pages, shuffled
  pages): finite, exactly zero on empty slots and padding rows, max abs error within the kernel tests' tolerance.
- engine (correctness): the engine with attention_backend="pallas" against "xla" on a mixed workload (prompts
  longer than the token budget, so prefills are chunked and ride with decodes), float KV pages and at full size
  int8 ones too: greedy tokens equal, request for request.
- bandwidth: the decode kernel's KV bytes / time beside a measured device copy (y = x + 1 over a large array,
  bytes read + written / time); medians of several timed runs.
- throughput: offline output tok/s (and TTFT / TPOT when experiments.throughput reports them) per model, through
  `python -m experiments.throughput` on a generated mixed workload.
- tensor_parallel (correctness): the engine with tensor_parallel_size = jax.device_count() against one device,
  greedy tokens equal; skipped, with the reason, on one device.

`--size=full` (the default on TPU/GPU) uses realistic shapes: 8B-like attention (32 q heads, 8 kv heads, head dim
128), pages of 16 and 32 tokens, 32-64 sequences, contexts to 4096; llama-tiny and llama-small. `--size=small` (the
default on CPU, where it is run in CI) runs the same code at toy sizes with the Pallas kernels in interpret mode,
so the check is known to work before it meets a device; its figures are smoke figures only (interpret mode times
the interpreter, not a kernel).

Each section runs in its own process by default (--isolate): a TPU is held by one process at a time (the
throughput section's child processes need it free), a GPU frees its memory only when the process that holds it
ends, and a section that crashes the interpreter or hangs (--section_timeout_s) is recorded as an error while the
others still run. One JSON (--output: the machine, then each section) and one printed table. The exit status is
1 when any section failed or raised, 0 otherwise.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

from absl import app, flags

from experiments.accelerator_plans import PLANS, EngineRun, KernelCase, Plan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository

_SIZE = flags.DEFINE_enum("size", None, ["small", "full"], "default: full on TPU/GPU, small on CPU")
_OUTPUT = flags.DEFINE_string("output", "results/accelerator_check.json", "the JSON report")
_SKIP = flags.DEFINE_list("skip", [], "sections not to run (recorded as skipped)")
_ISOLATE = flags.DEFINE_bool(
    "isolate",
    True,
    "each section in its own process (module docstring); --noisolate runs them all in this one, which starts faster "
    "but on a TPU keeps the chip from the throughput section's child processes",
)
_SECTION_TIMEOUT_S = flags.DEFINE_integer("section_timeout_s", None, "per section (--isolate); default: the size's")
# Internal: how the parent asks a child process for one section (or "machine", the machine's description).
_SECTION = flags.DEFINE_string("section", None, "internal: run this one section and write it to --section_output")
_SECTION_OUTPUT = flags.DEFINE_string("section_output", None, "internal: where --section writes its JSON")

# The kernel tests' tolerances (tests/kernels/kv_cache_builder.py): max abs error against the f32 reference.
TOLERANCE = {"float32": 2e-5, "bfloat16": 2e-2}
SPARE_PAGES = 3  # pages no sequence owns: they hold the poison


# ---- kernels ------------------------------------------------------------------------------------------------------


def paged_inputs(case: KernelCase, seed: int) -> dict:
    """A poisoned paged cache and queries for `case`: {"args": the kernel's positional args, "scales": int8 scales
    (or {}), "zero_rows": bool [rows], rows whose output must be exactly zero (empty slots, padding rows)}.

    Every page no sequence owns, and every row past a sequence's length in its last page, holds NaN (int8: its
    scale is NaN); page-table entries past a sequence's pages hold garbage ids; pages are a random permutation. The
    values are drawn on the device, so full-size caches never pass through the host."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from kernels_pallas import kv_quant

    rng = np.random.default_rng(seed)
    g, live = case.page_size, len(case.kv_lens)
    kv_lens = np.asarray(case.kv_lens, np.int64)
    slots = max(case.num_slots, live)
    pages_per_seq = max(1, -(-int(kv_lens.max()) // g))
    used = -(-kv_lens // g)
    num_pages = int(used.sum()) + SPARE_PAGES
    table = rng.integers(-num_pages, 2 * num_pages, (slots, pages_per_seq)).astype(np.int32)
    valid_rows = np.zeros(num_pages, np.int64)  # rows of each page that hold a live token
    order, start = rng.permutation(num_pages), 0
    for s, n in enumerate(used):
        pages, start = order[start : start + n], start + n
        table[s, :n] = pages
        valid_rows[pages] = np.minimum(g, kv_lens[s] - g * np.arange(n))
    row_ok = jnp.asarray(np.arange(g)[None, :] < valid_rows[:, None])[None, :, :, None]  # [1, P, G, 1]

    key_q, key_k, key_v = jax.random.split(jax.random.key(seed), 3)
    shape = (case.num_kv_heads, num_pages, g, case.head_dim)
    dtype = jnp.dtype(case.dtype)
    scales = {}
    if case.kv_int8:
        (k_pages, k_scales), (v_pages, v_scales) = (
            kv_quant.quantize(jax.random.normal(key, shape, jnp.float32)) for key in (key_k, key_v)
        )
        scales = dict(k_scales=jnp.where(row_ok, k_scales, jnp.nan), v_scales=jnp.where(row_ok, v_scales, jnp.nan))
    else:
        k_pages, v_pages = (jnp.where(row_ok, jax.random.normal(key, shape, dtype), jnp.nan) for key in (key_k, key_v))

    lens = np.zeros(slots, np.int32)
    lens[:live] = kv_lens
    if case.op == "decode":
        q = jax.random.normal(key_q, (live, case.num_heads, case.head_dim), dtype)
        args = (q, k_pages, v_pages, jnp.asarray(lens[:live]), jnp.asarray(table[:live]))
        return dict(args=args, scales=scales, zero_rows=kv_lens == 0)
    q_lens = np.asarray(case.q_lens, np.int64)
    cu = np.zeros(slots + 1, np.int32)
    cu[1 : live + 1] = np.cumsum(q_lens)
    cu[live + 1 :] = cu[live]
    q = jax.random.normal(key_q, (case.num_tokens, case.num_heads, case.head_dim), dtype)
    args = (q, k_pages, v_pages, jnp.asarray(lens), jnp.asarray(table), jnp.asarray(cu), jnp.asarray([live], jnp.int32))
    return dict(args=args, scales=scales, zero_rows=np.arange(case.num_tokens) >= q_lens.sum())


def kernel_and_reference(op: str):
    """(the Pallas kernel, its reference) of an op."""
    from kernels_pallas.paged_attention import paged_attention, reference_paged_attention
    from kernels_pallas.ragged_paged_attention import ragged_paged_attention, reference_ragged_paged_attention

    return {
        "decode": (paged_attention, reference_paged_attention),
        "ragged": (ragged_paged_attention, reference_ragged_paged_attention),
    }[op]


def interpret_mode() -> bool:
    """Pallas kernels run compiled on TPU/GPU; on CPU only the interpreter runs them."""
    import jax

    return jax.default_backend() not in ("tpu", "gpu")


def reference_by_kv_head(reference, args, scales, options):
    """The reference, one kv head (and its q heads) at a time: it materialises every token's whole context in f32,
    which for the full-size ragged case is tens of GB at once and a few GB per head. Exact: query head n only
    reads kv head n // (N / K)."""
    import jax
    import jax.numpy as jnp

    ref = jax.jit(reference, static_argnames=("sm_scale", "soft_cap", "sliding_window"))
    q, k_pages, v_pages, *meta = args
    num_kv_heads = k_pages.shape[0]
    r = q.shape[1] // num_kv_heads
    outs = []
    for h in range(num_kv_heads):
        head = slice(h, h + 1)
        outs.append(
            ref(
                q[:, h * r : (h + 1) * r],
                k_pages[head],
                v_pages[head],
                *meta,
                **{name: s[head] for name, s in scales.items()},
                **options,
            )
        )
    return jnp.concatenate(outs, axis=1)


def run_kernel_case(case: KernelCase, seed: int) -> dict:
    import jax
    import numpy as np

    inputs = paged_inputs(case, seed)
    kernel, reference = kernel_and_reference(case.op)
    options = dict(sliding_window=case.sliding_window, soft_cap=case.soft_cap)
    t0 = time.perf_counter()
    call = functools.partial(kernel, *inputs["args"], **inputs["scales"], **options, **case.kernel_options())
    out = jax.block_until_ready(call(interpret=interpret_mode()))
    first_call_s = time.perf_counter() - t0
    ref = reference_by_kv_head(reference, inputs["args"], inputs["scales"], options)
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    finite = bool(np.isfinite(out).all())
    zeros = bool((out[inputs["zero_rows"]] == 0).all())
    err = float(np.max(np.abs(out - ref))) if finite else float("inf")
    tol = TOLERANCE[case.dtype]
    return dict(
        case=case.name,
        passed=finite and zeros and err <= tol,
        max_abs_err=err,
        tolerance=tol,
        finite=finite,
        zero_rows_zero=zeros,
        shape=dict(
            N=case.num_heads,
            K=case.num_kv_heads,
            H=case.head_dim,
            G=case.page_size,
            seqs=len(case.kv_lens),
            max_ctx=max(case.kv_lens),
            tokens=case.num_tokens or len(case.kv_lens),
        ),
        first_call_s=round(first_call_s, 3),
    )


def check_kernels(plan: Plan) -> dict:
    cases = []
    for i, case in enumerate(plan.kernel_cases):
        try:
            cases.append(run_kernel_case(case, seed=i))
        except Exception as e:  # one case raising must not hide the others' results
            cases.append(dict(case=case.name, passed=False, error=_error_text(e)))
    failed = [c["case"] for c in cases if not c["passed"]]
    worst = max((c.get("max_abs_err", float("inf")) / c.get("tolerance", 1) for c in cases), default=0.0)
    return dict(
        status="fail" if failed else "pass",
        interpret=interpret_mode(),
        cases=cases,
        headline=f"{len(cases) - len(failed)}/{len(cases)} cases within tolerance, worst err/tol {worst:.2g}"
        + (f"; failed: {', '.join(failed)}" if failed else ""),
    )


# ---- engine -------------------------------------------------------------------------------------------------------


def engine_workload(run: EngineRun, seed: int):
    """Greedy requests with prompt and output lengths drawn from the run's ranges."""
    import numpy as np

    from cbjax import SamplingParams
    from cbjax.model import get_model_config

    vocab = get_model_config(run.model).vocab_size
    rng = np.random.default_rng(seed)
    prompts = [
        rng.integers(3, vocab, int(rng.integers(*run.prompt_range, endpoint=True))).tolist()
        for _ in range(run.num_requests)
    ]
    params = [
        SamplingParams(
            max_tokens=int(rng.integers(*run.max_tokens_range, endpoint=True)), temperature=0.0, ignore_eos=True
        )
        for _ in range(run.num_requests)
    ]
    return prompts, params


def engine_model(run: EngineRun):
    """The run's named shapes with its own init: a wide init (test-tiny's 0.2) gives greedy argmax clear margins,
    so a token mismatch between two attention paths means a bug, not a rounding tie between two logits."""
    from cbjax.model import get_model_config, init_model

    return init_model(get_model_config(run.model).replace(initializer_range=run.initializer_range), seed=0)


def compare_tokens(want: list[list[int]], got: list[list[int]]) -> dict:
    """Request-for-request equality, and where the first difference is."""
    mismatched = [i for i, (w, g) in enumerate(zip(want, got, strict=True)) if w != g]
    first = None
    if mismatched:
        i = mismatched[0]
        first = dict(
            request=i,
            position=next(
                (j for j, (a, b) in enumerate(zip(want[i], got[i])) if a != b), min(len(want[i]), len(got[i]))
            ),
        )
    return dict(equal=not mismatched, mismatched_requests=len(mismatched), first_mismatch=first)


def generate_tokens(model, prompts, params, **options) -> list[list[int]]:
    from cbjax import LLM

    return [o.outputs[0].token_ids for o in LLM(model, warmup=False, **options).generate(prompts, params)]


@contextlib.contextmanager
def float32_matmuls():
    """Every float32 dot at full float32 precision while the block runs (process-wide: the engines compile in
    background threads too). By default a float32 dot runs as TF32 on a GPU and as one bf16 pass on a TPU; two
    attention implementations then round differently enough for greedy tokens to part within 10-30 tokens (seen on
    an H200), which says nothing about either one's correctness. On CPU nothing changes."""
    import jax

    before = jax.config.jax_default_matmul_precision
    jax.config.update("jax_default_matmul_precision", "highest")
    try:
        yield
    finally:
        jax.config.update("jax_default_matmul_precision", before)


def check_engine(plan: Plan) -> dict:
    with float32_matmuls():
        return _check_engine(plan)


def _check_engine(plan: Plan) -> dict:
    run = plan.engine
    model = engine_model(run)
    prompts, params = engine_workload(run, seed=1)
    if max(map(len, prompts)) <= run.options["max_num_batched_tokens"]:
        raise ValueError("the engine workload needs a prompt longer than the token budget (chunked prefill)")
    pallas = dict(attention_backend="pallas", pallas_interpret=interpret_mode())
    comparisons = {}
    for kv in plan.engine_kv_cache_dtypes:
        opts = dict(run.options, kv_cache_dtype=kv)
        want = generate_tokens(model, prompts, params, attention_backend="xla", **opts)
        got = generate_tokens(model, prompts, params, **pallas, **opts)
        comparisons[f"kv_cache_dtype={kv}"] = dict(compare_tokens(want, got), output_tokens=sum(map(len, got)))
    ok = all(c["equal"] for c in comparisons.values())
    return dict(
        status="pass" if ok else "fail",
        model=run.model,
        initializer_range=run.initializer_range,
        requests=run.num_requests,
        longest_prompt=max(map(len, prompts)),
        options=run.options,
        comparisons=comparisons,
        headline="; ".join(
            f"{k}: " + ("tokens equal" if c["equal"] else f"{c['mismatched_requests']} requests differ")
            for k, c in comparisons.items()
        ),
    )


# ---- bandwidth ----------------------------------------------------------------------------------------------------


def median_seconds(fn, runs: int) -> float:
    """Median wall time of `runs` calls of `fn()`, after one that compiles and warms up."""
    import jax

    jax.block_until_ready(fn())
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_copy(num_bytes: int, runs: int) -> dict:
    """A streaming y = x + 1 over a float32 array: every byte read once and written once, far more than any cache
    holds. (An identity may be returned without copying; an add must touch every byte, as a copy would.)"""
    import jax
    import jax.numpy as jnp

    x = jnp.zeros((num_bytes // 4,), jnp.float32)
    add_one = jax.jit(lambda a: a + 1.0)
    seconds = median_seconds(lambda: add_one(x), runs)
    return dict(array_bytes=x.nbytes, seconds=seconds, bytes_per_s=2 * x.nbytes / seconds)


def measure_bandwidth(plan: Plan) -> dict:
    interpret = interpret_mode()
    copy = measure_copy(plan.copy_bytes, plan.timed_runs)
    cases = []
    for i, case in enumerate(plan.bandwidth_cases):
        inputs = paged_inputs(case, seed=100 + i)
        kernel, _ = kernel_and_reference(case.op)  # jitted already: each timed call is one dispatch
        call = functools.partial(
            kernel, *inputs["args"], **inputs["scales"], **case.kernel_options(), interpret=interpret
        )
        seconds = median_seconds(call, plan.timed_runs)
        bw = case.kv_bytes() / seconds
        cases.append(
            dict(
                case=case.name,
                kv_bytes=case.kv_bytes(),
                seconds=seconds,
                bytes_per_s=bw,
                fraction_of_copy=bw / copy["bytes_per_s"],
            )
        )
    head = cases[0]
    return dict(
        status="pass",
        smoke_only=interpret,
        note="interpret mode on CPU: these time the Pallas interpreter, not a kernel; smoke figures only"
        if interpret
        else "kernel: KV bytes (and int8 scales) of the live tokens / median time; copy: bytes read + written",
        timed_runs=plan.timed_runs,
        copy=copy,
        cases=cases,
        headline=f"{head['case']}: {head['bytes_per_s'] / 1e9:.3g} GB/s = {head['fraction_of_copy']:.2f} x copy "
        f"({copy['bytes_per_s'] / 1e9:.3g} GB/s)" + (" [smoke]" if interpret else ""),
    )


# ---- throughput ---------------------------------------------------------------------------------------------------


def measure_throughput(plan: Plan) -> dict:
    """experiments.throughput per model, as a child process: it is the command users run, and its engine then
    owns the device alone. This process never touches the device here (a TPU is held by one process at a time)."""
    from cbjax.bench.trace_files import save_peers_json
    from cbjax.bench.workload import make_workload

    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "workload.json")
        save_peers_json(make_workload(plan.throughput_workload), path)
        for model in plan.throughput_models:
            args = ["-m", "experiments.throughput", f"--workload={path}", f"--model={model}", *plan.throughput_flags]
            try:
                runs[model] = run_throughput(args, plan.section_timeout_s // len(plan.throughput_models))
                runs[model]["command"] = runs[model]["command"].replace(path, "WL.json")
            except Exception as e:  # one model failing must not hide the other's figures
                runs[model] = dict(error=_error_text(e))
    failed = [m for m, r in runs.items() if "error" in r]
    fields = plan.throughput_workload
    return dict(
        status="error" if failed else "pass",
        workload=fields,
        # The same requests, for running a command again by hand (make_workload is deterministic).
        workload_command="python -m experiments.write_workload --out WL.json --kind={kind} "
        "--num_requests={num_requests} --scale={scale} --seed={seed}".format(**fields),
        runs=runs,
        headline="; ".join(
            f"{m}: error" if "error" in r else f"{m}: {r['output_tok_per_s']:.4g} tok/s" + _latency_text(r)
            for m, r in runs.items()
        ),
    )


def run_throughput(args: list[str], timeout_s: int) -> dict:
    """One `python -m experiments.throughput` run: its headline figures (and TTFT / TPOT percentiles if given)."""
    proc = subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=_child_env(), capture_output=True, text=True, timeout=timeout_s
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"python {' '.join(args)} exited {proc.returncode}: {proc.stderr[-2000:]}")
    result = json.loads(lines[-1])
    latency = {k: v for k, v in result.items() if k.startswith(("ttft_ms", "tpot_ms"))}
    return dict(
        output_tok_per_s=result["output_tok_per_s"],
        output_tokens=result["output_tokens"],
        requests=result["requests"],
        wall_s=result["wall_s"],
        warmup_s=result["warmup_s"],
        compiles_after_warmup=result["compiles_after_warmup"],
        **(latency or {"ttft_tpot": "not reported by experiments.throughput"}),
        command=f"python {' '.join(args)}",
    )


def _latency_text(run: dict) -> str:
    if "ttft_ms_p50" in run and "tpot_ms_p50" in run:
        return f", TTFT p50 {run['ttft_ms_p50']:.4g} ms, TPOT p50 {run['tpot_ms_p50']:.3g} ms"
    return ""


# ---- tensor parallel ----------------------------------------------------------------------------------------------


def check_tensor_parallel(plan: Plan) -> dict:
    import jax

    n = jax.device_count()
    if n < 2:
        return dict(
            status="skip",
            reason=f"one device ({jax.devices()[0].device_kind}): nothing to split over",
            headline="skipped: one device",
        )
    run = plan.tensor_parallel
    model = engine_model(run)
    prompts, params = engine_workload(run, seed=2)
    with float32_matmuls():
        want = generate_tokens(model, prompts, params, **run.options)
        got = generate_tokens(model, prompts, params, tensor_parallel_size=n, **run.options)
    result = compare_tokens(want, got)
    return dict(
        status="pass" if result["equal"] else "fail",
        tensor_parallel_size=n,
        model=run.model,
        requests=run.num_requests,
        **result,
        headline=f"TP {n}: " + ("tokens equal one device's" if result["equal"] else "tokens differ"),
    )


# ---- running the sections -----------------------------------------------------------------------------------------

SECTIONS = {
    "kernels": check_kernels,
    "engine": check_engine,
    "bandwidth": measure_bandwidth,
    "throughput": measure_throughput,
    "tensor_parallel": check_tensor_parallel,
}
FAILED = ("fail", "error")  # the statuses that make the exit status 1


def machine_info() -> dict:
    """Backend, devices, versions, commit and date (cbjax.bench.results.manifest's provenance)."""
    import jax

    from cbjax.bench.results import manifest

    info = manifest(start_time=datetime.datetime.now().astimezone(), engines={})
    del info["engines"], info["command_line"]  # (the report has the parent's command line)
    return dict(backend=jax.default_backend(), **info)


def _error_text(e: BaseException) -> str:
    return "".join(traceback.format_exception(e))[-3000:]


def run_section(name: str, plan: Plan) -> dict:
    """One section in this process: its result, `seconds`, and status "error" with the traceback if it raised."""
    t0 = time.perf_counter()
    try:
        result = SECTIONS[name](plan)
    except Exception as e:
        result = dict(status="error", error=_error_text(e), headline=f"{type(e).__name__}: {e}"[:200])
    return dict(result, seconds=round(time.perf_counter() - t0, 2))


def _child_env() -> dict:
    return {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}


def section_command(name: str, size: str, output: str) -> list[str]:
    """The child process that runs one section (or "machine")."""
    module = ["-m", "experiments.accelerator_check"]
    return [sys.executable, *module, f"--size={size}", f"--section={name}", f"--section_output={output}"]


def run_isolated(name: str, size: str, timeout_s: int) -> dict:
    """One section in a child process; a child that dies or hangs is an error with its output's tail."""
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, f"{name}.json")
        try:
            proc = subprocess.run(
                section_command(name, size, path),
                cwd=ROOT,
                env=_child_env(),
                capture_output=True,
                text=True,
                timeout=timeout_s,
            )
            tail = (proc.stdout + proc.stderr)[-3000:]
            what = f"the section's process exited {proc.returncode} without a result"
        except subprocess.TimeoutExpired as e:
            # (the output captured before the timeout comes as bytes, even with text=True)
            tail = "".join(
                x.decode(errors="replace") if isinstance(x, bytes) else x for x in (e.stdout or "", e.stderr or "")
            )[-3000:]
            what = f"the section's process ran past {timeout_s} s and was stopped"
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                return json.load(f)
    return dict(status="error", error=f"{what}:\n{tail}", headline=what, seconds=round(time.perf_counter() - t0, 2))


def probe_machine(isolate: bool) -> dict:
    """machine_info(), from a child process when isolated: this process then never holds the device."""
    if not isolate:
        return machine_info()
    probe = run_isolated("machine", "small", 300)  # (the size does not matter to the probe)
    if "machine" not in probe:
        raise RuntimeError(f"could not describe the machine: {probe['error']}")
    return probe["machine"]


def run_check(size: str, machine: dict, skip=(), isolate: bool = True, timeout_s: int | None = None) -> dict:
    """Every section (those in `skip` recorded as skipped), in order: the report."""
    unknown = set(skip) - set(SECTIONS)
    if unknown:
        raise ValueError(f"unknown sections in --skip: {sorted(unknown)}; sections: {list(SECTIONS)}")
    plan = PLANS[size]()
    timeout_s = timeout_s or plan.section_timeout_s
    t0 = time.perf_counter()
    sections = {}
    for name in SECTIONS:
        if name in skip:
            sections[name] = dict(status="skip", reason="--skip", headline="skipped (--skip)", seconds=0.0)
        elif isolate:
            sections[name] = run_isolated(name, size, timeout_s)
        else:
            sections[name] = run_section(name, plan)
        print(f"[accelerator_check] {name}: {sections[name]['status']} ({sections[name]['seconds']} s)", flush=True)
    return dict(
        size=size,
        command_line=sys.argv,
        machine=machine,
        total_s=round(time.perf_counter() - t0, 1),
        sections=sections,
    )


def exit_status(report: dict) -> int:
    return int(any(s["status"] in FAILED for s in report["sections"].values()))


def table(report: dict) -> str:
    rows = [("section", "status", "seconds", "headline")]
    for name, s in report["sections"].items():
        rows.append((name, s["status"], f"{s['seconds']:.1f}", s.get("headline", "")))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r[:3], widths)) + "  " + r[3] for r in rows]
    m = report["machine"]
    device = m["device"]
    head = (
        f"accelerator check, size {report['size']}: {m['backend']} ({device['count']} x {device['kind']}), "
        f"jax {m['versions']['jax']}, commit {(m['git']['commit'] or '?')[:10]}, {report['total_s']} s"
    )
    return "\n".join([head, lines[0], "-" * len(lines[0]), *lines[1:]])


def write_report(path: str, report: dict) -> None:
    from cbjax.bench.results import write_json

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    write_json(path, report)


def main(argv):
    del argv
    if _SECTION.value is not None:  # a child: one section, written where the parent reads it
        name = _SECTION.value
        if name == "machine":
            result = dict(machine=machine_info())
        else:
            result = run_section(name, PLANS[_SIZE.value]())
        write_report(_SECTION_OUTPUT.value, result)
        return
    machine = probe_machine(_ISOLATE.value)
    size = _SIZE.value or ("small" if machine["backend"] == "cpu" else "full")
    if size == "full" and machine["backend"] == "cpu":
        print("[accelerator_check] --size=full on CPU interprets 8B-sized kernels: expect hours", flush=True)
    report = run_check(size, machine, _SKIP.value, isolate=_ISOLATE.value, timeout_s=_SECTION_TIMEOUT_S.value)
    write_report(_OUTPUT.value, report)
    print(table(report))
    print(f"written to {_OUTPUT.value}")
    sys.exit(exit_status(report))


if __name__ == "__main__":
    app.run(main)
