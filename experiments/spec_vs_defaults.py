"""Speculative decoding against the offline `LLM` default, as a new user meets it (issue 37; docs/speculative.md).

  python -m experiments.spec_vs_defaults [--methods=off,ngram,adaptive,draft] [--batches=1,64] [--rounds=3]
      [--tree DIR] [--before_tree DIR] --doc_data docs/data/spec_vs_defaults_DATE.json

Every method is `LLM("tinypy", speculative_config=...)` with the offline defaults (blocks of 8 decode steps per
dispatch, `max_num_seqs` 64, ...) and `warmup="full"`, built and warm before anything is timed:
  off        no speculation: the baseline, today's default
  ngram      prompt lookup, k = --k (4), as the engine runs it by default (since 2026-12-05: speculative blocks,
             up to 8 iterations of propose, verify and accept on the device per dispatch,
             cbjax/core/speculation/speculative_blocks.py; before, one verify step per dispatch)
  ngram_blocks  the same with speculative_config.device_blocks=True
  ngram_steps   the same with device_blocks=False: one verify step per dispatch, received before the next
             (a tree without the option runs its plain ngram: it had nothing else)
  adaptive   prompt lookup, k by batch size ({"1-8": 4, "9-32": 2, "33-": 0}; --adaptive=measured: k from the
             measured acceptance and step cost)
  draft      the packaged draft model tinypy-draft, k = --draft_k (3)
Prompts: held-out tinypy code prompts (experiments/speculative.py `code_prompts`: the last --prompt_len (64) tokens
before a line start in a standard-library file the model was not trained on; tinypy has 256 positions); each
request makes --max_tokens (180) greedy tokens, EOS ignored, so every method does the same work. Batch 1:
--prompts prompts, each alone (one `generate` per prompt, the times summed); batch 64: 64 prompts in one
`generate`. A round runs every (batch, method) once, the methods in an order rotated each round, so the machine's
drift touches every method; the table gives the medians and the ratio to `off` paired by round.
Every run's tokens are checked against `off`'s (greedy: they must be equal).

Each tree runs in its own worker process (this script with --worker, cwd and PYTHONPATH the tree), which builds its
engines once and then runs one round per request from this process: with --before_tree DIR (a checkout of an older
tree, e.g. `git archive HEAD | tar -x -C DIR`) the rounds of both trees interleave. --tree DIR measures that
checkout as the current one. The script is copied into those trees (both sides run the same harness); the prompts
are made here and handed to every worker. The data file's `commit` is this checkout's; `trees` gives each measured
tree's path and commit (None outside git). With two trees, the `medians` view by ["batch", "method", "tree"] with
baseline {"tree": "before"} and pair "round" gives each method's ratio of the current tree to the before tree.
"""

import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from absl import app, flags


def define_flags() -> None:
    """The command's flags, defined only when it runs (here or as experiments.draft_bound): a test imports this
    module beside others whose flags have the same names."""
    flags.DEFINE_list("methods", ["off", "ngram", "adaptive", "draft"], "speculation settings (see the docstring)")
    flags.DEFINE_list("batches", ["1", "64"], "1: each prompt alone; B > 1: B prompts in one generate")
    flags.DEFINE_integer("rounds", 3, "interleaved rounds; each runs every batch and method once")
    flags.DEFINE_integer("prompts", 6, "prompts of the batch-1 runs (each alone)")
    flags.DEFINE_integer("prompt_len", 64, "prompt tokens (+ max_tokens within the model's 256 positions)")
    flags.DEFINE_integer("max_tokens", 180, "greedy tokens per request (EOS ignored)")
    flags.DEFINE_integer("k", 4, "num_speculative_tokens of ngram and adaptive")
    flags.DEFINE_integer("draft_k", 3, "num_speculative_tokens of the draft model")
    flags.DEFINE_enum("adaptive", "batch_size", ["batch_size", "measured"], "the adaptive method's draft_length rule")
    flags.DEFINE_string("model", "tinypy", "packaged target model")
    flags.DEFINE_string("draft_model", "tinypy-draft", "the draft method's draft model")
    flags.DEFINE_string("tree", None, "the checkout measured as the current tree (default: this one)")
    flags.DEFINE_string("before_tree", None, "a checkout of the tree to compare with (its engine, this harness)")
    flags.DEFINE_string("doc_data", None, "the data file to write (cbjax/bench/doc_data.py)")
    flags.DEFINE_bool("worker", False, "internal: serve rounds for the parent on stdin/stdout")
    flags.DEFINE_string("prompts_file", None, "internal: the worker's prompts (JSON)")


FLAGS = flags.FLAGS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BATCH_TABLE = {"1-8": 4, "9-32": 2, "33-": 0}


def spec_config(method: str) -> dict | None:
    ngram = {"method": "ngram", "num_speculative_tokens": FLAGS.k, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    if FLAGS.adaptive == "batch_size":
        adaptive = {**ngram, "draft_length": "batch_size", "draft_length_table": BATCH_TABLE}
    else:
        adaptive = {**ngram, "draft_length": "measured"}
    draft = {"method": "draft", "draft_model": FLAGS.draft_model, "num_speculative_tokens": FLAGS.draft_k}
    configs = {
        "off": None,
        "ngram": ngram,
        "ngram_blocks": {**ngram, "device_blocks": True},
        "ngram_steps": {**ngram, "device_blocks": False},
        "adaptive": adaptive,
        "draft": draft,
    }
    if method not in configs:
        raise ValueError(f"unknown method {method!r}; known: {sorted(configs)}")
    return configs[method]


# ---- the worker: one tree's engines ----


def step_stats(records: list[dict]) -> dict:
    """What a run's step records say: steps, verifying steps, drafts and accepted drafts, and the median cost of a
    verifying step, of a plain dispatch (device + host time; a dispatch may be a block of decode steps) and of a plain
    decode step (a dispatch's time over its decode steps)."""
    verify = [r for r in records if drafts_of(r)]
    plain = [r for r in records if not drafts_of(r) and r["num_scheduled_tokens"] == r["num_scheduled_seqs"]]
    drafted = sum(drafts_of(r) for r in records)
    accepted = sum(r.get("spec_accepted_tokens", 0) for r in records)
    verified_seqs = sum(r.get("spec_verified_seqs", 0) for r in verify)

    def median_ms(rs, key=lambda r: r["device_s"] + r["host_s"]):
        return 1000 * statistics.median(key(r) for r in rs) if rs else None

    return dict(
        num_steps=len(records),
        num_verify_steps=len(verify),
        spec_draft_tokens=drafted,
        spec_accepted_tokens=accepted,
        spec_acceptance_rate=accepted / drafted if drafted else None,
        # tokens a verifying sequence gains per verifying step: 1 + its accepted drafts
        tokens_per_verify_step=1 + accepted / verified_seqs if verified_seqs else None,
        verify_step_ms=median_ms(verify),
        verify_host_ms=median_ms(verify, lambda r: r["host_s"]),
        plain_dispatch_ms=median_ms(plain),
        plain_step_ms=median_ms(plain, lambda r: (r["device_s"] + r["host_s"]) / r.get("decode_steps", 1)),
        decode_steps=sum(r.get("decode_steps", 1) for r in records),
        spec_drafted_by_position=sum_lists(r.get("spec_drafted_by_position") for r in verify),
        spec_accepted_by_position=sum_lists(r.get("spec_accepted_by_position") for r in verify),
    )


def drafts_of(record: dict) -> int:
    """The drafts a step verified: a speculative block's (proposed on the device, so not in its plan's
    spec_draft_tokens) are those its speculator tallied by position."""
    return record.get("spec_draft_tokens") or sum(record.get("spec_drafted_by_position") or ())


def sum_lists(lists) -> list[int]:
    """Element-wise sums of lists of any lengths (a step's counts by draft position)."""
    total: list[int] = []
    for values in lists:
        for i, v in enumerate(values or []):
            total += [0] * (i + 1 - len(total))
            total[i] += v
    return total


def run_batch(llm, prompts: list, batch: int) -> dict:
    """One timed run: batch 1 generates each prompt alone, batch B the first B prompts in one call."""
    from cbjax import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=FLAGS.max_tokens, ignore_eos=True)
    calls = [[p] for p in prompts[: FLAGS.prompts]] if batch == 1 else [prompts[:batch]]
    engine = llm.engine
    first, compiles = len(engine.step_records), engine.num_compiles
    gc.collect()
    load_before = os.getloadavg()[0]
    outputs, seconds = [], 0.0
    for call in calls:
        t0 = time.perf_counter()
        result = llm.generate(call, params)
        seconds += time.perf_counter() - t0
        outputs += [list(o.outputs[0].token_ids) for o in result]
    tokens = sum(len(o) for o in outputs)
    if tokens != len(outputs) * FLAGS.max_tokens:  # every method must do the same work
        raise RuntimeError(f"{tokens} tokens generated, {len(outputs)} x {FLAGS.max_tokens} asked for")
    return dict(
        batch=batch,
        output_throughput=tokens / seconds,
        seconds=seconds,
        output_tokens=tokens,
        compiles=engine.num_compiles - compiles,
        digest=hash_outputs(outputs),
        load_average_before=load_before,
        load_average_after=os.getloadavg()[0],
        **step_stats(engine.step_records[first:]),
    )


def hash_outputs(outputs: list[list[int]]) -> str:
    import hashlib

    return hashlib.sha256(json.dumps(outputs).encode()).hexdigest()[:16]


def worker() -> None:
    """Build and warm every method's LLM, say so on stdout, then run each round asked for on stdin."""
    from cbjax import LLM

    with open(FLAGS.prompts_file) as f:
        prompts = json.load(f)
    t0 = time.perf_counter()
    llms = {m: LLM(FLAGS.model, speculative_config=known_options(spec_config(m)), warmup="full") for m in FLAGS.methods}
    for llm in llms.values():
        llm.engine.wait_until_warm()
        run_batch(llm, prompts, 1)  # untimed: the first calls of a program pay for more than its compile
    reply({"ready": True, "build_s": time.perf_counter() - t0})
    for line in sys.stdin:
        ask = json.loads(line)
        order = (
            FLAGS.methods[ask["rotate"] % len(FLAGS.methods) :] + FLAGS.methods[: ask["rotate"] % len(FLAGS.methods)]
        )
        runs = [dict(method=m, **run_batch(llms[m], prompts, ask["batch"])) for m in order]
        reply({"runs": runs})


def known_options(spec: dict | None) -> dict | None:
    """`spec` without the options this tree's SpeculativeConfig lacks (an older tree measured beside this one:
    device_blocks=False is what it always ran)."""
    import dataclasses

    from cbjax.core.speculation.config import SpeculativeConfig

    if spec is None:
        return None
    known = {f.name for f in dataclasses.fields(SpeculativeConfig)}
    if spec.get("device_blocks") and "device_blocks" not in known:
        raise ValueError("this tree has no speculative blocks (speculative_config.device_blocks)")
    return {k: v for k, v in spec.items() if k in known}


def reply(obj: dict) -> None:
    sys.stdout.write("@@" + json.dumps(obj) + "\n")  # marked: the engine may log to stdout too
    sys.stdout.flush()


# ---- the parent: prompts, workers, rounds, the data file ----


class Worker:
    def __init__(self, tree: str, prompts_file: str, argv: list[str]):
        cmd = [sys.executable, "-m", "experiments.spec_vs_defaults", "--worker", "--prompts_file", prompts_file, *argv]
        env = os.environ | {"PYTHONPATH": tree}
        self.proc = subprocess.Popen(cmd, cwd=tree, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def read(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith("@@"):
                return json.loads(line[2:])
        raise RuntimeError(f"worker exited with {self.proc.wait()}")

    def ask(self, **request) -> dict:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def worker_argv() -> list[str]:
    names = ("methods", "prompts", "max_tokens", "k", "draft_k", "adaptive", "model", "draft_model")
    return [f"--{n}={','.join(v) if isinstance(v := getattr(FLAGS, n), list) else v}" for n in names]


def main(argv):
    del argv
    if FLAGS.worker:
        return worker()
    if not FLAGS.doc_data:
        raise app.UsageError("--doc_data: the data file to write is required")
    if "off" not in FLAGS.methods:
        raise app.UsageError("--methods must include off (the baseline)")
    from cbjax.bench.doc_data import git_commit, write_doc_data
    from cbjax.model.registry import model_config_of, packaged_model_path
    from cbjax.model.tokenizer import Tokenizer
    from experiments.speculative import code_prompts

    batches = [int(b) for b in FLAGS.batches]
    positions = model_config_of(FLAGS.model).max_position_embeddings
    if FLAGS.prompt_len + FLAGS.max_tokens > positions:
        raise app.UsageError(f"--prompt_len + --max_tokens exceed {FLAGS.model}'s {positions} positions")
    tok = Tokenizer.from_dir(packaged_model_path(FLAGS.model))
    prompts = code_prompts(tok, max(FLAGS.prompts, *batches), FLAGS.prompt_len)
    trees = {"current": os.path.abspath(FLAGS.tree or ROOT)}
    if FLAGS.before_tree:
        trees["before"] = os.path.abspath(FLAGS.before_tree)
    for tree in trees.values():  # the same harness on every side
        if tree != ROOT:
            shutil.copy(os.path.abspath(__file__), os.path.join(tree, "experiments", "spec_vs_defaults.py"))
    load_at_start = list(os.getloadavg())
    runs, build_s = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "prompts.json")
        with open(path, "w") as f:
            json.dump(prompts, f)
        workers = {}
        try:
            for name, tree in trees.items():  # one at a time: two builds at once would share the 2 cores
                workers[name] = Worker(tree, path, worker_argv())
                build_s[name] = workers[name].read()["build_s"]
                print(f"{name}: engines built and warm in {build_s[name]:.0f} s", flush=True)
            for rnd in range(1, FLAGS.rounds + 1):
                for batch in batches:
                    for name, w in workers.items():
                        for run in w.ask(batch=batch, rotate=rnd - 1)["runs"]:
                            runs.append(dict(tree=name, round=rnd, **run))
                            print(f"round {rnd} {name} batch {batch} {run['method']}: "
                                  f"{run['output_throughput']:.0f} tok/s", flush=True)  # fmt: skip
        finally:
            for w in workers.values():
                w.close()
    reference = {r["batch"]: r["digest"] for r in runs if r["tree"] == "current" and r["method"] == "off"}
    for r in runs:
        r["same_outputs"] = r["digest"] == reference[r["batch"]]
    command = "python -m experiments.spec_vs_defaults " + " ".join(
        [f"--rounds={FLAGS.rounds}", f"--batches={','.join(FLAGS.batches)}", f"--prompt_len={FLAGS.prompt_len}"]
        + worker_argv()
        + ([f"--tree {FLAGS.tree}"] if FLAGS.tree else [])
        + ([f"--before_tree {FLAGS.before_tree}"] if FLAGS.before_tree else [])
    )
    write_doc_data(
        FLAGS.doc_data,
        command=command,
        runs=runs,
        what="speculative decoding against the offline LLM default (blocks of 8 decode steps), tinypy on held-out "
        "code, batch 1 (each prompt alone) and 64, rounds interleaved (docs/speculative.md)",
        settings=dict(prompt_len=FLAGS.prompt_len, batch_table=BATCH_TABLE, warmup="full"),
        build_s=build_s,
        trees={name: dict(zip(("path", "commit", "dirty"), (tree, *git_commit(tree)))) for name, tree in trees.items()},
        load_average_before=load_at_start,
        load_average_after=list(os.getloadavg()),
    )
    print(f"wrote {FLAGS.doc_data}; outputs equal to off's: {all(r['same_outputs'] for r in runs)}")


if __name__ == "__main__":
    define_flags()
    app.run(main)
