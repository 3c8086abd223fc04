"""Start-up: seconds from a fresh Python process to the first generated token of `LLM(MODEL)`.

  python -m experiments.startup --model llama-tiny [--warm_runs 3] [--engine_options '{"warmup": "full"}']
      [--fresh_home] [--install [--install_before DIR]] [--lock /tmp/cbjax-cpu.lock]
      [--doc_data docs/data/startup_DATE.json]

Runs one process on an empty persistent compilation cache (cold: every program compiles), then `--warm_runs`
processes on the same cache (a second process, as after a notebook restart), and prints one JSON line per process:
the time to import cbjax, to build the engine, to the first token (one 16-token prompt, max_tokens=1), and the
compile counts. The clock starts before `import cbjax`, in the child process itself.

--fresh_home: every process gets the same new, empty HOME and XDG_CACHE_HOME, so the cold process also builds the
C++ CPU kernels (cached under $XDG_CACHE_HOME/cbjax/kernels) unless the install built them (setup.py; a source tree
installed editable keeps them in kernels_pallas/cpu/prebuilt/): the first start a new user sees. Without it the
kernels already built on this machine are reused and only the compilation cache is empty. Each process records
where its kernel library came from ("kernels": "install" for the one setup.py built into the package, "cache" for
the user's cache, null for none), so a cold run that loaded a prebuilt library says so.
--install: first install this tree into two new venvs, timed (`pip install --no-deps -e .`, the dependencies
reached from this interpreter's site-packages through a .pth file, as .ci/check_wheel does): once with the
install-time kernel build turned off (CBJAX_INSTALL_KERNELS=off), once with it (setup.py); the processes then run
in the second venv. --install_before DIR: first the same install of the tree DIR (e.g. `git archive HEAD | tar -x
-C DIR`), whose build environment may be lighter (no jax in it). The installs say what moving the one-time build
to install time costs; with --fresh_home nothing built on this machine before is reused, at install or at run time.
--doc_data PATH: also write the runs as a data file for the docs (cbjax/bench/doc_data.py), each with the load
average before and after its process. --lock PATH: hold the machine's measurement lock (experiments/measurement_lock.py)
for each install and each process, released between them.
"""

import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

from absl import app, flags

from experiments.measurement_lock import held

flags.DEFINE_string("model", "llama-tiny", "model name")
flags.DEFINE_integer("warm_runs", 3, "processes run on the warm cache after the cold one")
flags.DEFINE_string("engine_options", "{}", "JSON dict of extra LLM options")
flags.DEFINE_string("cache_dir", None, "persistent cache to use (default: a fresh temporary directory)")
flags.DEFINE_bool("fresh_home", False, "empty HOME and XDG_CACHE_HOME: the cold process builds the C++ kernels too")
flags.DEFINE_bool("install", False, "time installs of this tree into new venvs, then run the processes in one")
flags.DEFINE_string("install_before", None, "with --install: also time an install of this tree (the code before)")
flags.DEFINE_string("doc_data", None, "also write the runs as a data file for the docs (docs/data/*.json)")
flags.DEFINE_string("lock", None, "flock held for each install and each process (the machine's measurement lock)")
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
from kernels_pallas.cpu import library
lib = library.library_path()
kernels = None if lib is None else "install" if lib.parent == library.PREBUILT_DIR else "cache"
print(json.dumps(dict(import_s=round(t1 - t0, 2), engine_s=round(t2 - t1, 2), first_token_s=round(t3 - t2, 2),
                      total_s=round(t3 - t0, 2), compiles=c.num_compiles, cache_hits=c.num_cache_hits,
                      buckets=len(llm.engine.buckets.token_buckets), kernels=kernels)))
"""


def child_env(cache: str, fresh_home: bool) -> dict:
    """The children's environment: the compilation cache at `cache`; with `fresh_home`, a new empty HOME and
    XDG_CACHE_HOME (shared by every child, so only the first builds the kernels)."""
    env = {**os.environ, "CBJAX_COMPILATION_CACHE": cache, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    if fresh_home:
        env["HOME"] = tempfile.mkdtemp(prefix="cbjax-startup-home-")
        env["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="cbjax-startup-xdg-")
    return env


ROOT = str(pathlib.Path(__file__).resolve().parents[1])


def purelib(python: str) -> str:
    """The site-packages folder of the interpreter `python`."""
    code = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    return subprocess.run([python, "-c", code], capture_output=True, text=True, check=True).stdout.strip()


def install(env: dict, kernels: bool, tree: str = ROOT, label: str = "install") -> tuple[str, dict]:
    """This tree installed editable into a new venv, with the install-time kernel build on or off; returns the
    venv's python and the run (the install's seconds, the venv's creation left out). The dependencies come from
    this interpreter's site-packages through a .pth file, so that the time is cbjax's own install: its build
    environment (setuptools, and jax and jaxlib for the kernels) and setup.py's build."""
    venv = tempfile.mkdtemp(prefix="cbjax-startup-venv-")
    subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    python = os.path.join(venv, "bin", "python")
    pathlib.Path(purelib(python), "startup_dependencies.pth").write_text(purelib(sys.executable) + "\n")
    before = load_average()
    started, t0 = time.time(), time.perf_counter()
    r = subprocess.run(
        [python, "-m", "pip", "install", "-q", "--no-deps", "-e", tree],
        capture_output=True,
        text=True,
        env={**env, "CBJAX_INSTALL_KERNELS": "on" if kernels else "off"},
        check=False,
    )
    seconds = time.perf_counter() - t0
    if r.returncode:
        sys.exit(r.stderr)
    # pip keeps setup.py's messages to itself: the editable install's library in the source tree says it was built.
    prebuilt = pathlib.Path(tree, "kernels_pallas", "cpu", "prebuilt").glob("cpu_kernels-*.so")
    built = any(path.stat().st_mtime >= started for path in prebuilt)
    if kernels and not built:
        sys.exit(f"the install did not build the kernels:\n{r.stderr}")
    run = dict(phase="install", run=label, kernels_at_install=built, install_s=round(seconds, 2))
    print(json.dumps(run), flush=True)
    return python, {**run, "load_average_before": before, "load_average_after": load_average()}


def load_average() -> float:
    """The 1-minute load average (the machine is shared: a busy minute shows here)."""
    return round(os.getloadavg()[0], 2)


def main(argv):
    del argv
    cache = FLAGS.cache_dir or tempfile.mkdtemp(prefix="cbjax-startup-")
    env = child_env(cache, FLAGS.fresh_home)
    python, installs = sys.executable, []
    if FLAGS.install_before:
        with held(FLAGS.lock):
            installs.append(install(env, False, os.path.abspath(FLAGS.install_before), "before")[1])
    if FLAGS.install:
        for kernels in (False, True):
            with held(FLAGS.lock):
                python, run = install(env, kernels)
            installs.append(run)
    runs = []
    for i in range(1 + FLAGS.warm_runs):
        with held(FLAGS.lock):
            before = load_average()
            r = subprocess.run(
                [python, "-c", _CHILD, FLAGS.model, FLAGS.engine_options],
                capture_output=True,
                text=True,
                env=env,
                check=False,
            )
        if r.returncode:
            sys.exit(r.stderr)
        result = json.loads(r.stdout.strip().splitlines()[-1])
        run = {"phase": "start", "run": "cold" if i == 0 else "warm", "model": FLAGS.model, **result}
        print(json.dumps(run), flush=True)
        runs.append({**run, "load_average_before": before, "load_average_after": load_average()})
    if FLAGS.doc_data:
        from cbjax.bench.doc_data import write_doc_data

        command = f"python -m experiments.startup --model {FLAGS.model} --warm_runs {FLAGS.warm_runs}"
        if FLAGS.engine_options != "{}":
            command += f" --engine_options '{FLAGS.engine_options}'"
        if FLAGS.fresh_home:
            command += " --fresh_home"
        if FLAGS.install:
            command += " --install"
        if FLAGS.install_before:
            command += " --install_before DIR"
        what = "seconds from a new Python process to the first token of LLM(model): one cold process, then warm ones"
        if FLAGS.fresh_home:
            what += "; the cold one on an empty HOME and cache, so it builds the C++ kernels unless the install did"
        if FLAGS.install:
            what += "; first (phase install) this tree installed into new venvs, without and with the kernel build"
        write_doc_data(FLAGS.doc_data, command=command, runs=installs + runs, what=what, fresh_home=FLAGS.fresh_home,
                       engine_options=json.loads(FLAGS.engine_options))  # fmt: skip


if __name__ == "__main__":
    app.run(main)
