"""Throughput in the first minute after `LLM()` returns, against the same process's steady state, speculation on:
does the background building of the step programs take the cores from the steps being served? (issue 37: at least
80% of steady state.)

  python -m experiments.first_minute [--methods ngram,draft] [--seconds 60] [--steady_seconds 30] [--repeats 3]
      [--before_tree DIR] [--lock /tmp/cbjax-cpu.lock] [--doc_data docs/data/first_minute_DATE.json]

Each method runs in a new Python process on an empty compilation cache (every step program builds, in the
background by default), with the packaged `tinypy` and its held-out code prompts (experiments/speculative.py):
`LLM(tinypy, speculative_config=...)`, then one prompt per `generate` call (batch 1, 64 greedy tokens, EOS ignored)
over and over for --seconds from the moment `LLM()` returned; then `wait_until_warm()` and the same calls for
--steady_seconds. Output tokens per second of each phase (whole calls: tokens of the calls over their wall time) and
their ratio. The C++ kernels are the ones already built on this machine (this measures the program builds, not the
kernel build: experiments/startup.py has that). --before_tree: run each method in that tree too (e.g. `git archive
HEAD | tar -x -C DIR`), interleaved, to compare with the code before a change.

--repeats N runs the whole set (every method, every tree) N times, interleaved (repeat 1 of everything, then repeat
2, ...), each run its own process on its own empty cache; the end prints, per method and tree, the median of
first / steady over the repeats with the 95% bootstrap interval of that median (cbjax/bench/intervals.py). --lock
holds the machine's measurement lock (experiments/measurement_lock.py) for each run, one process, and releases it
between runs. --doc_data is rewritten after every run, so an interrupted sitting keeps what it measured.
"""

import json
import os
import subprocess
import sys
import tempfile

from absl import app, flags

from cbjax.bench.intervals import format_interval, median_interval
from experiments.measurement_lock import held


def define_flags() -> None:
    """The command's flags, defined only when it runs: a test imports this module beside others whose flags have
    the same names."""
    flags.DEFINE_list("methods", ["ngram", "draft"], "speculation methods: ngram (k=4) or draft (tinypy-draft, k=4)")
    flags.DEFINE_float("seconds", 60.0, "the first phase: seconds of calls from the end of LLM()")
    flags.DEFINE_float("steady_seconds", 30.0, "the steady phase, after wait_until_warm()")
    flags.DEFINE_integer("max_tokens", 64, "generated tokens per call")
    flags.DEFINE_string("before_tree", None, "also run every method in this source tree (the code before a change)")
    flags.DEFINE_integer("repeats", 1, "runs of every method and tree, interleaved, each a new process", lower_bound=1)
    flags.DEFINE_string("lock", None, "flock held for each run (the machine's measurement lock)")
    flags.DEFINE_string("doc_data", None, "also write the runs as a data file for the docs (docs/data/*.json)")


FLAGS = flags.FLAGS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPECS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4},
    "draft": {"method": "draft", "num_speculative_tokens": 4, "draft_model": "tinypy-draft"},
}

_CHILD = """
import json, sys, time
spec, seconds, steady_seconds, max_tokens, prompts = json.loads(sys.argv[1])
from cbjax import LLM, SamplingParams
llm = LLM("tinypy", speculative_config=spec)
params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

def phase(limit):
    start, tokens, calls, i = time.perf_counter(), 0, 0, 0
    while time.perf_counter() - start < limit:
        out = llm.generate([prompts[i % len(prompts)]], params)
        tokens += len(out[0].outputs[0].token_ids)
        calls, i = calls + 1, i + 1
    return tokens, calls, time.perf_counter() - start

first = phase(seconds)
llm.engine.wait_until_warm()
steady = phase(steady_seconds)
print(json.dumps(dict(first_tokens=first[0], first_calls=first[1], first_s=round(first[2], 2),
                      steady_tokens=steady[0], steady_calls=steady[1], steady_s=round(steady[2], 2))))
"""


def prompts(n: int = 8) -> list[list[int]]:
    """Held-out code prompts of 160 tokens (experiments/speculative.py's)."""
    from cbjax.model.registry import resolve_checkpoint
    from cbjax.model.tokenizer import Tokenizer
    from experiments.speculative import code_prompts

    return code_prompts(Tokenizer.from_dir(resolve_checkpoint("tinypy")[0]), n, 160)


def run(tree: str, method: str, code_prompts: list) -> dict:
    """One process of `tree` on an empty compilation cache; its figures."""
    payload = json.dumps([SPECS[method], FLAGS.seconds, FLAGS.steady_seconds, FLAGS.max_tokens, code_prompts])
    env = {**os.environ, "CBJAX_COMPILATION_CACHE": tempfile.mkdtemp(prefix="cbjax-first-minute-"),
           "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu"), "PYTHONPATH": tree}  # fmt: skip
    before = round(os.getloadavg()[0], 2)
    r = subprocess.run([sys.executable, "-c", _CHILD, payload], capture_output=True, text=True, env=env, cwd=tree)
    if r.returncode:
        sys.exit(r.stderr)
    fig = json.loads(r.stdout.strip().splitlines()[-1])
    first, steady = fig["first_tokens"] / fig["first_s"], fig["steady_tokens"] / fig["steady_s"]
    return {
        **fig,
        "first_tok_s": round(first, 1),
        "steady_tok_s": round(steady, 1),
        "first_vs_steady": round(first / steady, 3),
        "load_average_before": before,
        "load_average_after": round(os.getloadavg()[0], 2),
    }


def schedule(methods: list[str], trees: list[str], repeats: int) -> list[tuple[int, str, str]]:
    """(repeat, method, tree) of every run in the order they run: all of repeat 1, then all of repeat 2, ... so
    that a slow minute of the shared machine falls on one repeat of everything rather than on one method."""
    return [(r, m, t) for r in range(1, repeats + 1) for m in methods for t in trees]


def summary(runs: list[dict]) -> list[dict]:
    """Per (method, tree), in the order first run: the median of first / steady over its runs, the 95% interval
    of that median (NaN bounds with one run) and every run's value."""
    groups: dict[tuple[str, str], list[float]] = {}
    for r in runs:
        groups.setdefault((r["method"], r["tree"]), []).append(r["first_vs_steady"])
    out = []
    for (method, tree), values in groups.items():
        iv = median_interval(values)
        out.append(dict(method=method, tree=tree, first_vs_steady=iv.median, interval=[iv.low, iv.high],
                        runs=values, text=format_interval(iv, "{:.2f}")))  # fmt: skip
    return out


def main(argv):
    del argv
    unknown = sorted(set(FLAGS.methods) - set(SPECS))
    if unknown:
        raise ValueError(f"--methods must be among {sorted(SPECS)}, got {unknown}")
    trees = {"this": ROOT, **({"before": os.path.abspath(FLAGS.before_tree)} if FLAGS.before_tree else {})}
    code = prompts()
    command = (
        f"python -m experiments.first_minute --methods {','.join(FLAGS.methods)} --seconds {FLAGS.seconds:g} "
        f"--steady_seconds {FLAGS.steady_seconds:g}"
        + (f" --repeats {FLAGS.repeats}" if FLAGS.repeats > 1 else "")
        + (" --before_tree DIR" if FLAGS.before_tree else "")
    )
    what = (
        "output tokens/s of batch-1 generate calls (tinypy, held-out code prompts, speculation on) in the first "
        "seconds after LLM() returned on an empty compilation cache, and after wait_until_warm(), same process"
    )
    runs = []
    for repeat, method, name in schedule(FLAGS.methods, list(trees), FLAGS.repeats):
        with held(FLAGS.lock):
            result = {"method": method, "tree": name, "repeat": repeat, **run(trees[name], method, code)}
        print(json.dumps(result), flush=True)
        runs.append(result)
        if FLAGS.doc_data:
            from cbjax.bench.doc_data import write_doc_data

            write_doc_data(FLAGS.doc_data, command=command, runs=runs, what=what, max_tokens=FLAGS.max_tokens,
                           repeats=FLAGS.repeats)  # fmt: skip
    for s in summary(runs):
        print(json.dumps(s), flush=True)


if __name__ == "__main__":
    define_flags()
    app.run(main)
