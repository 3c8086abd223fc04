"""Speculative decoding inside continuous batching: where it pays and where it hurts (docs/speculative.md).

  python -m experiments.speculative [--batch_sizes=1,4,16,64] [--methods=off,ngram,draft,adaptive,...] [--repeats=3]

The packaged `tinypy` model completes Python code: each prompt is 160 tokens of a held-out standard-library file
(every 50th file, the split the model was not trained on; experiments/train_tiny.py), cut at a line start; each
request generates 64 tokens (greedy, EOS ignored, so every method does the same work). For each batch size B the
engine gets B slots and max(8, 2B) requests at once (offline); then an online run with Poisson arrivals. Methods:

  off        no speculation (asynchronous scheduling, as the engine runs by default)
  ngram      prompt lookup, k = 4 drafts per sequence and step
  adaptive   prompt lookup, k by batch size: {"1-8": 4, "9-32": 2, "33-": 0}
  measured   prompt lookup, k from the measured acceptance and step cost (cbjax/core/speculation/draft_length.py)
  draft      the packaged draft model (`tinypy-draft`), k = 4, proposing on the device in the verifying step
  draft_adaptive  the draft model, k by batch size: {"1-8": 4, "9-32": 2, "33-": 0}
  draft_k2   the draft model, k = 2

Runs are interleaved (every method at a batch size, then again) and the medians of --repeats reported, with the
ratios to `off` measured in the same sitting. Engines are built and warmed up before anything is timed.
Also measures the n-gram proposer's cost per call on short and long contexts. "step ms": the median cost (device +
host) of a plain decode step / of a verifying step. Writes --output (JSON) and, with --doc_data=PATH, every raw
run (batch, method, repeat, figures) as a docs data file (docs/speculative.md's table is generated from one).
"""

import gc
import json
import os
import statistics
import sys
import sysconfig
import time

import numpy as np
from absl import app, flags

FLAGS = flags.FLAGS

VAL_EVERY = 50  # experiments/train_tiny.py's held-out split: every 50th stdlib file (configs/train_tiny.py)
BATCH_TABLE = {"1-8": 4, "9-32": 2, "33-": 0}


def define_flags() -> None:
    """The command's flags, defined only when it runs as the program (a test imports the module beside others whose
    flags have the same names)."""
    flags.DEFINE_list("batch_sizes", ["1", "4", "16", "64"], "slots per engine (offline runs: max(8, 2x) requests)")
    flags.DEFINE_list(
        "methods", ["off", "ngram", "draft", "adaptive", "draft_adaptive"], "speculation settings (see the docstring)"
    )
    flags.DEFINE_string("draft_model", "tinypy-draft", "the draft model of the draft methods")
    flags.DEFINE_integer("repeats", 3, "interleaved repeats; medians reported")
    flags.DEFINE_integer("prompt_len", 160, "prompt tokens")
    flags.DEFINE_integer("max_tokens", 64, "generated tokens per request")
    flags.DEFINE_integer("k", 4, "num_speculative_tokens")
    flags.DEFINE_float("online_rate", 16.0, "online run: Poisson arrivals per second (0: no online run)")
    flags.DEFINE_integer("online_requests", 96, "online run: requests")
    flags.DEFINE_integer("online_slots", 64, "online run: max_num_seqs")
    flags.DEFINE_string("model", "tinypy", "packaged model")
    flags.DEFINE_string("output", "results/speculative.json", "results file")
    flags.DEFINE_string("write_workload", None, "only write the code prompts as a JSONL workload to this file and exit")
    flags.DEFINE_string("doc_data", None, "also write every raw run as a docs data file (cbjax/bench/doc_data.py)")


def held_out_files() -> list[str]:
    """The stdlib files tinypy was not trained on (the same walk and split as experiments/train_tiny.py)."""
    root = sysconfig.get_paths()["stdlib"]
    skip = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skip and not d.startswith("."))
        files += [os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(".py")]
    return [p for i, p in enumerate(sorted(files)) if i % VAL_EVERY == VAL_EVERY - 1]


def code_prompts(tokenizer, n: int, prompt_len: int, seed: int = 0) -> list[list[int]]:
    """n prompts of prompt_len tokens ending at a line start of a held-out file (the model continues the code)."""
    rng = np.random.default_rng(seed)
    texts = []
    for path in held_out_files():
        try:
            with open(path, encoding="utf-8") as f:
                texts.append(f.read())
        except (UnicodeDecodeError, OSError):
            continue
    prompts = []
    while len(prompts) < n:
        text = texts[int(rng.integers(len(texts)))]
        starts = [i + 1 for i, c in enumerate(text) if c == "\n"]
        if len(starts) < 50:
            continue
        cut = starts[int(rng.integers(40, len(starts)))]
        ids = tokenizer.encode(text[:cut], add_special_tokens=False)
        if len(ids) >= prompt_len:
            prompts.append(ids[-prompt_len:])
    return prompts


def num_requests(batch_size: int) -> int:
    return max(8, 2 * batch_size)


def spec_config(method: str):
    base = {"method": "ngram", "num_speculative_tokens": FLAGS.k, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    draft = {"method": "draft", "num_speculative_tokens": FLAGS.k, "draft_model": FLAGS.draft_model}
    table = {"draft_length": "batch_size", "draft_length_table": BATCH_TABLE}
    return {
        "off": None,
        "ngram": base,
        "adaptive": {**base, **table},
        "measured": {**base, "draft_length": "measured"},
        "draft": draft,
        "draft_adaptive": {**draft, **table},
        "draft_k2": {**draft, "num_speculative_tokens": 2},
    }[method]


def build_engine(method: str, slots: int):
    from cbjax import LLMEngine

    return LLMEngine(
        FLAGS.model,
        max_num_seqs=slots,
        max_num_batched_tokens=512,
        page_size=16,
        num_pages=1100,
        max_model_len=FLAGS.prompt_len + FLAGS.max_tokens,
        speculative_config=spec_config(method),
        warmup="full",
    )


def workload(prompts, arrivals) -> list:
    from cbjax.bench.requests import WorkloadRequest

    return [
        WorkloadRequest(f"r{i}", float(t), tuple(p), FLAGS.max_tokens)
        for i, (p, t) in enumerate(zip(prompts, arrivals))
    ]


def run_once(engine, wl) -> dict:
    from cbjax.bench.metrics import acceptance_by_position, summarize
    from cbjax.bench.online import run_online

    compiles = engine.num_compiles
    result = run_online(engine, wl)
    s = summarize(result.requests, result.steps)
    assert engine.num_compiles == compiles, "compiled during a timed run"
    return dict(
        output_tok_s=s["output_throughput"],
        itl_ms_p50=s["itl_ms_p50"],
        itl_ms_mean=s["itl_ms_mean"],
        tpot_ms_p50=s["tpot_ms_p50"],
        ttft_ms_p50=s["ttft_ms_p50"],
        acceptance_rate=s["spec_acceptance_rate"],
        mean_acceptance_length=s["spec_mean_acceptance_length"],
        acceptance_by_position=acceptance_by_position(result.steps),
        drafts_per_step=s["spec_drafts_per_step"],
        num_steps=s["num_steps"],
        # What a step costs (device + host time of the step records, median ms), plain decode steps (one token
        # per sequence) and verifying ones apart: where speculation's time goes.
        plain_step_ms=_median_ms([r for r in result.steps if r.num_scheduled_tokens == r.num_scheduled_seqs > 0]),
        verify_step_ms=_median_ms([r for r in result.steps if r.spec_draft_tokens]),
        outputs=result.output_token_ids,
    )


def _median_ms(records) -> float:
    return 1000 * statistics.median(r.device_s + r.host_s for r in records) if records else float("nan")


def proposer_cost() -> dict:
    """Microseconds per propose() call, on contexts of a few lengths built from repeated code-like token runs."""
    from cbjax.core.speculation.ngram import NgramProposer

    rng = np.random.default_rng(0)
    proposer = NgramProposer(2, 4)
    out = {}
    for L in (256, 2048, 32768):
        ctx = rng.integers(0, 4096, L).astype(np.int32)  # as the speculator keeps it (speculator.context_array)
        ctx[-3:] = ctx[L // 2 : L // 2 + 3]  # a match exists
        n = max(20, 200_000 // L)
        t0 = time.perf_counter()
        for _ in range(n):
            proposer.propose(ctx, 4)
        out[L] = (time.perf_counter() - t0) / n * 1e6
    return out


def median_of(runs: list[dict]) -> dict:
    keys = [k for k in runs[0] if isinstance(runs[0][k], float | int) and not isinstance(runs[0][k], bool)]
    med = {k: statistics.median(r[k] for r in runs) for k in keys}
    med["acceptance_by_position"] = runs[-1]["acceptance_by_position"]
    return med


def main(argv):
    del argv
    from cbjax.model.registry import packaged_model_path
    from cbjax.model.tokenizer import Tokenizer
    from cbjax.runner.compilation.program_family import clear_shared_programs

    load_at_start = list(os.getloadavg())
    tok = Tokenizer.from_dir(packaged_model_path(FLAGS.model))
    if FLAGS.write_workload:  # for compare_policies (configs/speculative.py): arrivals are drawn there
        with open(FLAGS.write_workload, "w") as f:
            for i, p in enumerate(code_prompts(tok, FLAGS.online_requests, FLAGS.prompt_len)):
                line = dict(request_id=f"code-{i}", prompt_token_ids=p, max_tokens=FLAGS.max_tokens)
                f.write(json.dumps(line) + "\n")
        return
    sizes = [int(b) for b in FLAGS.batch_sizes]
    methods = list(FLAGS.methods)
    prompts = code_prompts(tok, max(num_requests(max(sizes)), FLAGS.online_requests), FLAGS.prompt_len)
    print(f"proposer cost (us per call by context length): {proposer_cost()}", flush=True)
    online = FLAGS.online_rate > 0
    arrivals = np.cumsum(np.random.default_rng(1).exponential(1 / max(FLAGS.online_rate, 1e-9), FLAGS.online_requests))
    # One group of engines per slot count (the online run shares the engines of its slot count), built, warmed up,
    # run --repeats times interleaved, then released with their programs: every batch size's programs alive at
    # once (~180 with the draft model's) exhausted the process's memory maps in LLVM's JIT.
    groups: dict = {}
    for b in sizes:
        groups.setdefault(b, []).append(b)
    if online:
        groups.setdefault(FLAGS.online_slots, []).append("online")
    runs: dict = {}
    for slots, runs_here in groups.items():
        t0 = time.perf_counter()
        engines = {m: build_engine(m, slots) for m in methods}
        for engine in engines.values():
            engine.wait_until_warm()
        print(f"{slots} slots: engines built and warm in {time.perf_counter() - t0:.0f} s", flush=True)
        for rep in range(FLAGS.repeats):
            for b in runs_here:
                if b == "online":
                    wl = workload(prompts[: FLAGS.online_requests], arrivals - arrivals[0])
                else:
                    wl = workload(prompts[: num_requests(b)], [0.0] * num_requests(b))
                for m in methods:
                    load_before = os.getloadavg()[0]
                    r = run_once(engines[m], wl)
                    r.update(load_average_before=load_before, load_average_after=os.getloadavg()[0])
                    runs.setdefault((m, b), []).append(r)
                    print(
                        f"rep {rep} batch {b} {m}: {r['output_tok_s']:.0f} tok/s, acc {r['acceptance_rate']:.2f}",
                        flush=True,
                    )
        del engines
        clear_shared_programs()
        gc.collect()
    rows = []
    for b in [*sizes, *(["online"] if online else [])]:
        for m in methods:
            med = median_of(runs[m, b])
            same = all(r["outputs"] == runs["off", b][0]["outputs"] for r in runs[m, b])
            # The ratio of each interleaved repeat to its own `off` run, then the median (same sitting, same load).
            ratios = [r["output_tok_s"] / o["output_tok_s"] for r, o in zip(runs[m, b], runs["off", b])]
            rows.append(dict(batch=b, method=m, speedup=statistics.median(ratios), same_outputs=same, **med))
    print_table(rows)
    proposer_us = proposer_cost()  # at the end as well as the start: the machine's load moves it
    os.makedirs(os.path.dirname(FLAGS.output) or ".", exist_ok=True)
    with open(FLAGS.output, "w") as f:
        json.dump(dict(argv=sys.argv, rows=rows, proposer_us=proposer_us), f, indent=1, default=str)
    print(f"wrote {FLAGS.output}")
    if FLAGS.doc_data:
        from cbjax.bench.doc_data import write_doc_data

        order = [*sizes, *(["online"] if online else [])]
        write_doc_data(
            FLAGS.doc_data,
            command=" ".join(["python -m experiments.speculative", *sys.argv[1:]]),
            runs=doc_runs(runs, order, methods),
            what="speculative decoding on tinypy completing held-out Python code: each method's runs at each batch "
            "size, interleaved repeats (docs/speculative.md)",
            settings=dict(
                model=FLAGS.model,
                draft_model=FLAGS.draft_model,
                k=FLAGS.k,
                prompt_len=FLAGS.prompt_len,
                max_tokens=FLAGS.max_tokens,
                batch_table=BATCH_TABLE,
                online_rate=FLAGS.online_rate,
                online_requests=FLAGS.online_requests,
                online_slots=FLAGS.online_slots,
            ),
            proposer_us=proposer_us,
            load_average_before=load_at_start,
            load_average_after=list(os.getloadavg()),
        )
        print(f"wrote {FLAGS.doc_data}")


# The figures of a run that a data file keeps, under summarize's names where it has one (the docs' tables know
# those: experiments/doc_views.py LABELS).
DOC_FIELDS = {
    "output_tok_s": "output_throughput",
    "itl_ms_p50": "itl_ms_p50",
    "itl_ms_mean": "itl_ms_mean",
    "tpot_ms_p50": "tpot_ms_p50",
    "ttft_ms_p50": "ttft_ms_p50",
    "acceptance_rate": "spec_acceptance_rate",
    "mean_acceptance_length": "spec_mean_acceptance_length",
    "acceptance_by_position": "spec_acceptance_by_position",
    "drafts_per_step": "spec_drafts_per_step",
    "num_steps": "num_steps",
    "plain_step_ms": "plain_step_ms",
    "verify_step_ms": "verify_step_ms",
    "load_average_before": "load_average_before",
    "load_average_after": "load_average_after",
}


def doc_runs(runs: dict, batches: list, methods: list) -> list[dict]:
    """One raw record per (batch, method, repeat) of `runs` ({(method, batch): [run_once's dict per repeat]}), in
    the order they ran within a batch: repeat by repeat, every method. `repeat` (1-based) pairs a method's run with
    `off`'s of the same repeat; `same_outputs` says whether its tokens equal `off`'s first run (None without
    `off`)."""
    out = []
    for b in batches:
        for rep in range(max(len(runs[m, b]) for m in methods)):
            for m in methods:
                if rep >= len(runs[m, b]):
                    continue
                r = runs[m, b][rep]
                ref = runs["off", b][0]["outputs"] if ("off", b) in runs else None
                record = dict(batch=b, method=m, repeat=rep + 1)
                record.update({new: r[old] for old, new in DOC_FIELDS.items() if old in r})
                record["same_outputs"] = None if ref is None else r["outputs"] == ref
                out.append(record)
    return out


def print_table(rows) -> None:
    head = "batch  method          out tok/s  vs off  ITL p50 ms  TPOT p50 ms  accept  acc len  same out  step ms"
    print(head)
    for r in rows:
        acc = "-" if r["acceptance_rate"] != r["acceptance_rate"] else f"{r['acceptance_rate']:.0%}"
        alen = (
            "-" if r["mean_acceptance_length"] != r["mean_acceptance_length"] else f"{r['mean_acceptance_length']:.2f}"
        )
        print(
            f"{r['batch']!s:>5}  {r['method']:<14} {r['output_tok_s']:>10.0f}  {r['speedup']:>5.2f}x"
            f"  {r['itl_ms_p50']:>10.2f}  {r['tpot_ms_p50']:>11.2f}  {acc:>6}  {alen:>7}  {r['same_outputs']!s:>8}"
            f"  {r['plain_step_ms']:.2f} / {r['verify_step_ms']:.2f}"
        )


if __name__ == "__main__":
    define_flags()
    app.run(main)
