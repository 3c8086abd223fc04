"""Throughput in the first minute after `LLM()` returns, against the same process's steady state, speculation on:
does the background building of the step programs take the cores from the steps being served? (issue 37: at least
80% of steady state.)

  python -m experiments.first_minute [--methods ngram,draft] [--seconds 60] [--steady_seconds 30]
      [--before_tree DIR] [--doc_data docs/data/first_minute_DATE.json]

Each method runs in a new Python process on an empty compilation cache (every step program builds, in the
background by default), with the packaged `tinypy` and its held-out code prompts (experiments/speculative.py):
`LLM(tinypy, speculative_config=...)`, then one prompt per `generate` call (batch 1, 64 greedy tokens, EOS ignored)
over and over for --seconds from the moment `LLM()` returned; then `wait_until_warm()` and the same calls for
--steady_seconds. Output tokens per second of each phase (whole calls: tokens of the calls over their wall time) and
their ratio. The C++ kernels are the ones already built on this machine (this measures the program builds, not the
kernel build: experiments/startup.py has that). --before_tree: run each method in that tree too (e.g. `git archive
HEAD | tar -x -C DIR`), interleaved, to compare with the code before a change.
"""

import json
import os
import subprocess
import sys
import tempfile

from absl import app, flags

flags.DEFINE_list("methods", ["ngram", "draft"], "speculation methods: ngram (k=4) or draft (tinypy-draft, k=4)")
flags.DEFINE_float("seconds", 60.0, "the first phase: seconds of calls from the end of LLM()")
flags.DEFINE_float("steady_seconds", 30.0, "the steady phase, after wait_until_warm()")
flags.DEFINE_integer("max_tokens", 64, "generated tokens per call")
flags.DEFINE_string("before_tree", None, "also run every method in this source tree (the code before a change)")
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


def main(argv):
    del argv
    unknown = sorted(set(FLAGS.methods) - set(SPECS))
    if unknown:
        raise ValueError(f"--methods must be among {sorted(SPECS)}, got {unknown}")
    trees = [("this", ROOT)] + ([("before", os.path.abspath(FLAGS.before_tree))] if FLAGS.before_tree else [])
    code = prompts()
    runs = []
    for method in FLAGS.methods:
        for name, tree in trees:
            result = {"method": method, "tree": name, **run(tree, method, code)}
            print(json.dumps(result), flush=True)
            runs.append(result)
    if FLAGS.doc_data:
        from cbjax.bench.doc_data import write_doc_data

        command = (
            f"python -m experiments.first_minute --methods {','.join(FLAGS.methods)} --seconds {FLAGS.seconds:g} "
            f"--steady_seconds {FLAGS.steady_seconds:g}" + (" --before_tree DIR" if FLAGS.before_tree else "")
        )
        what = (
            "output tokens/s of batch-1 generate calls (tinypy, held-out code prompts, speculation on) in the first "
            "seconds after LLM() returned on an empty compilation cache, and after wait_until_warm(), same process"
        )
        write_doc_data(FLAGS.doc_data, command=command, runs=runs, what=what, max_tokens=FLAGS.max_tokens)


if __name__ == "__main__":
    app.run(main)
