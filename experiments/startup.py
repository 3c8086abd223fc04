"""Start-up: seconds from a fresh Python process to the first generated token of `LLM(MODEL)`.

  python -m experiments.startup --model llama-tiny [--warm_runs 3] [--engine_options '{"warmup": "full"}']

Runs one process on an empty persistent compilation cache (cold: every program compiles), then `--warm_runs`
processes on the same cache (a second process, as after a notebook restart), and prints one JSON line per process:
the time to import cbjax, to build the engine, to the first token (one 16-token prompt, max_tokens=1), and the
compile counts. The clock starts before `import cbjax`, in the child process itself.
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


def main(argv):
    del argv
    cache = FLAGS.cache_dir or tempfile.mkdtemp(prefix="cbjax-startup-")
    env = {**os.environ, "CBJAX_COMPILATION_CACHE": cache, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    for i in range(1 + FLAGS.warm_runs):
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
        print(json.dumps({"run": "cold" if i == 0 else "warm", "model": FLAGS.model, **result}), flush=True)


if __name__ == "__main__":
    app.run(main)
