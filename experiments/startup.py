"""Start-up: seconds from a fresh Python process to the first generated token of `LLM(MODEL)`.

  python -m experiments.startup --model llama-tiny [--warm_runs 3] [--engine_options '{"warmup": "full"}']
      [--fresh_home] [--doc_data docs/data/startup_DATE.json]

Runs one process on an empty persistent compilation cache (cold: every program compiles), then `--warm_runs`
processes on the same cache (a second process, as after a notebook restart), and prints one JSON line per process:
the time to import cbjax, to build the engine, to the first token (one 16-token prompt, max_tokens=1), and the
compile counts. The clock starts before `import cbjax`, in the child process itself.

--fresh_home: every process gets the same new, empty HOME and XDG_CACHE_HOME, so the cold process also builds the
C++ CPU kernels (cached under $XDG_CACHE_HOME/cbjax/kernels): the first start a new user sees. Without it the
kernels already built on this machine are reused and only the compilation cache is empty.
--doc_data PATH: also write the runs as a data file for the docs (cbjax/bench/doc_data.py), each with the load
average before and after its process.
"""

import json
import os
import subprocess
import sys
import tempfile

from absl import app, flags

flags.DEFINE_string("model", "llama-tiny", "model name")
flags.DEFINE_integer("warm_runs", 3, "processes run on the warm cache after the cold one")
flags.DEFINE_string("engine_options", "{}", "JSON dict of extra LLM options")
flags.DEFINE_string("cache_dir", None, "persistent cache to use (default: a fresh temporary directory)")
flags.DEFINE_bool("fresh_home", False, "empty HOME and XDG_CACHE_HOME: the cold process builds the C++ kernels too")
flags.DEFINE_string("doc_data", None, "also write the runs as a data file for the docs (docs/data/*.json)")
FLAGS = flags.FLAGS

_CHILD = """
import time
t0 = time.perf_counter()
import json, sys
from cbjax import LLM, SamplingParams
t1 = time.perf_counter()
llm = LLM(sys.argv[1], **json.loads(sys.argv[2]))
t2 = time.perf_counter()
out = llm.generate([list(range(3, 19))], SamplingParams(max_tokens=1, temperature=0.0))
t3 = time.perf_counter()
assert len(out[0].outputs[0].token_ids) == 1
c = llm.engine.runner.compiles
print(json.dumps(dict(import_s=round(t1 - t0, 2), engine_s=round(t2 - t1, 2), first_token_s=round(t3 - t2, 2),
                      total_s=round(t3 - t0, 2), compiles=c.num_compiles, cache_hits=c.num_cache_hits,
                      buckets=len(llm.engine.buckets.token_buckets))))
"""


def child_env(cache: str, fresh_home: bool) -> dict:
    """The children's environment: the compilation cache at `cache`; with `fresh_home`, a new empty HOME and
    XDG_CACHE_HOME (shared by every child, so only the first builds the kernels)."""
    env = {**os.environ, "CBJAX_COMPILATION_CACHE": cache, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    if fresh_home:
        env["HOME"] = tempfile.mkdtemp(prefix="cbjax-startup-home-")
        env["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="cbjax-startup-xdg-")
    return env


def load_average() -> float:
    """The 1-minute load average (the machine is shared: a busy minute shows here)."""
    return round(os.getloadavg()[0], 2)


def main(argv):
    del argv
    cache = FLAGS.cache_dir or tempfile.mkdtemp(prefix="cbjax-startup-")
    env = child_env(cache, FLAGS.fresh_home)
    runs = []
    for i in range(1 + FLAGS.warm_runs):
        before = load_average()
        r = subprocess.run(
            [sys.executable, "-c", _CHILD, FLAGS.model, FLAGS.engine_options],
            capture_output=True,
            text=True,
            env=env,
            check=False,
        )
        if r.returncode:
            sys.exit(r.stderr)
        result = json.loads(r.stdout.strip().splitlines()[-1])
        run = {"run": "cold" if i == 0 else "warm", "model": FLAGS.model, **result}
        print(json.dumps(run), flush=True)
        runs.append({**run, "load_average_before": before, "load_average_after": load_average()})
    if FLAGS.doc_data:
        from cbjax.bench.doc_data import write_doc_data

        command = f"python -m experiments.startup --model {FLAGS.model} --warm_runs {FLAGS.warm_runs}"
        if FLAGS.engine_options != "{}":
            command += f" --engine_options '{FLAGS.engine_options}'"
        if FLAGS.fresh_home:
            command += " --fresh_home"
        what = "seconds from a new Python process to the first token of LLM(model): one cold process, then warm ones"
        if FLAGS.fresh_home:
            what += "; the cold one on an empty HOME and cache, so it builds the C++ kernels too"
        write_doc_data(FLAGS.doc_data, command=command, runs=runs, what=what, fresh_home=FLAGS.fresh_home,
                       engine_options=json.loads(FLAGS.engine_options))  # fmt: skip


if __name__ == "__main__":
    app.run(main)
