"""How many of a simulated comparison's steps event skipping could take: per entry, the steps that are decode-only
with nothing waiting (what cbjax/core/multi_step.py's plan_decode_steps needs before it plans a stretch of steps
whose decisions are foregone conclusions) and, as a loose upper bound, the decode-only steps that repeat the step
before them (the same numbers of scheduled, running and waiting requests).

  python -m experiments.sim_event_skipping --config=configs/sim_zoo.py [--policies=fcfs,static] \\
      [--doc_data=docs/data/sim_event_skipping_DATE.json]

Why: skipping from event to event (the next arrival and the next finish are known to the simulator) would make a
simulated run cost per event instead of per step, but only over stretches where every step decides the same. The
counts say how much of a run such stretches hold; the simulator is deterministic, so they are counts, not samples.
"""

import sys

from absl import app, flags

from experiments import compare_policies as cp  # defines --config
from experiments.bench_sim_speed import at_load
from experiments.comparison_config import only_entries

FLAGS = flags.FLAGS


def define_flags() -> None:
    """The command's flags, defined only when it runs as the program (tests import the module)."""
    flags.DEFINE_list("policies", None, "a subset of config.policies (default: all)")
    flags.DEFINE_string("doc_data", None, "also write a data file for the docs (one record per entry) to this path")


def skippable_steps(steps) -> dict:
    """The counts of one run's step records (cbjax.bench.metrics.StepRecord)."""
    decode = [s.num_scheduled_seqs > 0 and s.num_scheduled_tokens == s.num_scheduled_seqs for s in steps]
    idle_queue = sum(1 for s, d in zip(steps, decode) if d and s.num_waiting == 0)
    shape = [(s.num_scheduled_seqs, s.num_running, s.num_waiting) for s in steps]
    repeats = sum(1 for i in range(1, len(steps)) if decode[i] and shape[i] == shape[i - 1])
    n = max(len(steps), 1)
    return dict(
        steps=len(steps),
        decode_nothing_waiting=idle_queue,
        decode_nothing_waiting_share=idle_queue / n,
        decode_repeating=repeats,
        decode_repeating_share=repeats / n,
    )


def main(argv):
    del argv
    cfg = cp.load_config()
    names = FLAGS.policies or list(cfg.policies)
    only_entries(cfg, names)
    try:
        cfg, workload = cp.prepare_run(cfg)
    except ValueError as e:
        sys.exit(f"sim_event_skipping: {e}")
    cfg, workload, _ = at_load(cfg, workload)
    runs = []
    for name in names:
        with cfg.unlocked():
            cfg.policies = (name,)
        counts = skippable_steps(cp.run_comparison(cfg, workload=workload, progress=False).results[name].steps)
        runs.append(dict(policy=name, **counts))
        c = counts
        print(
            f"{name:>14}: {c['steps']:6d} steps; decode-only, nothing waiting {c['decode_nothing_waiting']:5d}"
            f" ({c['decode_nothing_waiting_share']:.1%}); decode-only repeating the step before"
            f" {c['decode_repeating']:5d} ({c['decode_repeating_share']:.1%})",
            flush=True,
        )
    if FLAGS.doc_data:
        from cbjax.bench.doc_data import write_doc_data

        write_doc_data(
            FLAGS.doc_data,
            command=f"python -m experiments.sim_event_skipping {' '.join(sys.argv[1:])}",
            runs=runs,
            what="per zoo entry: its simulated steps and those event skipping could take (counts; deterministic)",
            num_requests=len(workload),
        )
        print(f"data: {FLAGS.doc_data}")


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=cp.parse_flags)
