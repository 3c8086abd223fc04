"""The host's share of a run at 64 running sequences, several ways of dispatching and reading outputs, in rounds.

  python ../shared/peers/make_workload.py decode64.json --prompt 64 64 --gen 256 256
  python -m experiments.host_time --workload decode64.json --rounds 2 --repeats 5 \\
      [--before_tree DIR] [--lock /tmp/cbjax_measure.lock] --doc_data docs/data/host_time_DATE.json

Each variant is one `experiments.throughput` process (--replay_device --host_split, llama-tiny) with its own flags;
every round runs each variant once, in order, so a drift of the shared machine touches every variant alike:
- "stream, 1 step": LLMEngine.step() with every token streamed (the server's way; issue 37's online case),
- "finished only, 1 step": LLM.generate with one step per dispatch (the engine builds final outputs only),
- "blocks (LLM)": LLM.generate with its default blocks of decode steps,
- "stream, blocks of 8": LLMEngine.step() with every token streamed and num_scheduler_steps=8: on the CPU each
  block's rows reach the host one per step() (cbjax/runner/token_stream.py), an older tree's all at a block's end,
- "stream, blocks of 16": the same with num_scheduler_steps=16 (half the per-block host work per token, twice the
  wait of a request that arrives during a block),
- with --tree DIR, the current variants run in that checkout instead of this one (e.g. a commit with only the
  changes being measured applied);
- with --before_tree DIR (a checkout of an older tree, e.g. `git archive HEAD | tar -x -C DIR`), also "before:
  stream, 1 step": that tree's engine streaming, driven by this tree's experiments/throughput.py (copied there, so
  both sides run the same harness).
The processes' data files are merged into one (cbjax/bench/doc_data.py): one run per timed repeat, labelled with its
variant (`dispatch`), round, and `pair` (round * 10 + repeat: repeats of one round are paired across variants).
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile

from absl import app, flags

from experiments import throughput  # noqa: F401  (its flags: --workload, --repeats, --doc_data: the merged file)
from experiments.measurement_lock import held

flags.DEFINE_integer("rounds", 2, "rounds; each runs every variant once")
flags.DEFINE_string("before_tree", None, "a checkout of the tree to compare with (its engine, this harness)")
flags.DEFINE_string("tree", None, "the tree measured as the current one (default: this checkout)")
flags.DEFINE_string("lock", None, "flock held for each process (the machine's measurement lock), released between")
FLAGS = flags.FLAGS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VARIANTS = {  # name: (flags over the common ones, run in the before tree)
    "before: stream, 1 step": (["--stream", "--num_scheduler_steps", "1"], True),
    "stream, 1 step": (["--stream", "--num_scheduler_steps", "1"], False),
    "finished only, 1 step": (["--num_scheduler_steps", "1"], False),
    "blocks (LLM)": ([], False),
    "stream, blocks of 8": (["--stream", "--num_scheduler_steps", "8"], False),
    "stream, blocks of 16": (["--stream", "--num_scheduler_steps", "16"], False),
}


def run_variant(name: str, extra: list, before: bool, path: str) -> dict:
    """One throughput process; returns its data file."""
    cwd = FLAGS.before_tree if before else (FLAGS.tree or ROOT)
    cmd = [sys.executable, "-m", "experiments.throughput", "--workload", os.path.abspath(FLAGS.workload)]
    cmd += ["--model", "llama-tiny", "--repeats", str(FLAGS.repeats), "--replay_device", "--host_split", *extra]
    with held(FLAGS.lock):
        subprocess.run([*cmd, "--doc_data", path], cwd=cwd, check=True, env=os.environ | {"PYTHONPATH": cwd})
    with open(path) as f:
        return json.load(f)


def main(argv):
    del argv
    from cbjax.bench.doc_data import write_doc_data

    if not FLAGS.doc_data:
        raise app.UsageError("--doc_data: the data file to write is required")

    variants = {k: v for k, v in VARIANTS.items() if FLAGS.before_tree or not v[1]}
    for tree in (FLAGS.before_tree, FLAGS.tree):  # the same harness on every side
        if tree:
            shutil.copy(os.path.join(ROOT, "experiments", "throughput.py"), os.path.join(tree, "experiments"))
    load_before = os.getloadavg()
    runs, results = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(1, FLAGS.rounds + 1):
            for i, (name, (extra, before)) in enumerate(variants.items()):
                data = run_variant(name, extra, before, os.path.join(tmp, f"{rnd}_{i}.json"))
                results[f"{name} #{rnd}"] = data["result"] | {"commit": data["commit"], "dirty": data["dirty"]}
                for run in data["runs"]:
                    runs.append(run | {"dispatch": name, "round": rnd, "pair": 10 * rnd + run["repeat"]})
    before = f" --before_tree {FLAGS.before_tree}" if FLAGS.before_tree else ""
    before += f" --tree {FLAGS.tree}" if FLAGS.tree else ""
    command = (
        f"python -m experiments.host_time --workload {os.path.basename(FLAGS.workload)} --rounds {FLAGS.rounds} "
        f"--repeats {FLAGS.repeats}{before}"
    )
    write_doc_data(
        FLAGS.doc_data,
        command=command,
        runs=runs,
        what="the host's share of a decode-only run at 64 running sequences, llama-tiny, by dispatch and outputs",
        results=results,
        trees={"before": FLAGS.before_tree, "current": FLAGS.tree or ROOT},  # (the commit above is this checkout's)
        load_average=[*load_before, *os.getloadavg()],
    )


if __name__ == "__main__":
    app.run(main)
