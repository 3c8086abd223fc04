"""How fast the simulator runs a compare_policies config: per policy, the wall and CPU seconds of the simulated run
(engine, scheduler, policy, cost model; not the results files), the median of --repeats runs.

  python -m experiments.bench_sim_speed --config=configs/sim_zoo.py [--repeats=3] [--policies=fcfs,static] \\
      [--doc_data=docs/data/sim_speed_DATE.json]

The repeats are interleaved: each goes through every policy once, starting one policy later than the repeat
before, so a slow minute of a shared machine falls on all of them. With `workload.load` the capacity run that sets
the arrival rate is made once, before the timed runs, and timed on its own (`capacity`). A repeat's `total` is the
wall time of all its policies' runs, timed as one. CPU seconds are this process's (time.process_time): on a shared
machine they move much less with the other jobs' load than wall seconds, which is why both are kept, with the load
average before and after every run. --doc_data writes every run (cbjax/bench/doc_data.py) for the docs' tables.
"""

import os
import statistics
import sys
import time

from absl import app, flags

from experiments import compare_policies as cp  # defines --config
from experiments.comparison_config import only_entries

FLAGS = flags.FLAGS


def define_flags() -> None:
    """The command's flags, defined only when it runs as the program (a test imports the module beside others whose
    flags have the same names)."""
    flags.DEFINE_integer("repeats", 3, "runs per policy, interleaved (the median is printed)")
    flags.DEFINE_list("policies", None, "a subset of config.policies (default: all)")
    flags.DEFINE_string("doc_data", None, "also write a data file for the docs (every run, raw) to this path")


def _timed(fn):
    """fn()'s result and its wall and CPU seconds, with the 1-minute load average before and after."""
    before = os.getloadavg()[0]
    t, c = time.perf_counter(), time.process_time()
    out = fn()
    wall, cpu = time.perf_counter() - t, time.process_time() - c
    return out, dict(wall_s=wall, cpu_s=cpu, load_average_before=before, load_average_after=os.getloadavg()[0])


def at_load(cfg, requests):
    """With `workload.load`: the capacity measured on `requests`, and (the config, the workload) at that load's
    rate, the rate now absolute; without one, (cfg, requests, None)."""
    from experiments.load_harness import workloads_at

    load = cp.load_of(cfg)
    if load is None:
        return cfg, requests, None
    capacity = cp.measure_capacity(cfg, requests, progress=False)
    cfg = cfg.copy_and_resolve_references()
    cfg.workload.request_rate, cfg.workload.load = capacity.rate_at(load), 0.0  # 0: no load, the rate is absolute
    return cfg, workloads_at(cfg, seeds=1)[0], capacity.to_dict(load)


def bench(cfg, requests, names: list[str], repeats: int) -> tuple[list[dict], dict | None]:
    """The timed runs of `requests` (compare_policies.prepare_run's workload): one record per (policy, repeat), plus
    one `total` per repeat; and the capacity run's record (None without a load)."""
    (cfg, workload, capacity), t = _timed(lambda: at_load(cfg, requests))
    cap_record = None if capacity is None else dict(t, **capacity)
    runs = []
    for rep in range(repeats):
        k = rep % len(names)

        def one_repeat(order=names[k:] + names[:k], rep=rep):
            for name in order:
                with cfg.unlocked():
                    cfg.policies = (name,)
                comp, t = _timed(lambda: cp.run_comparison(cfg, workload=workload, progress=False))
                tokens = sum(len(ids) for ids in comp.results[name].output_token_ids.values())
                runs.append(dict(policy=name, run=rep + 1, **t, generated_tokens=tokens))
                print(f"run {rep + 1} {name:>14}: wall {t['wall_s']:6.1f} s  cpu {t['cpu_s']:6.1f} s", flush=True)

        _, t = _timed(one_repeat)
        runs.append(dict(policy="total", run=rep + 1, **t))
        print(f"run {rep + 1} {'total':>14}: wall {t['wall_s']:6.1f} s  cpu {t['cpu_s']:6.1f} s", flush=True)
    return runs, cap_record


def main(argv):
    del argv
    cfg = cp.load_config()
    names = FLAGS.policies or list(cfg.policies)
    only_entries(cfg, names)
    try:
        cfg, workload = cp.prepare_run(cfg)
    except ValueError as e:
        sys.exit(f"bench_sim_speed: {e}")
    load_before = os.getloadavg()
    runs, capacity = bench(cfg, workload, names, FLAGS.repeats)
    load_after = os.getloadavg()
    print()
    if capacity is not None:
        print(f"{'capacity run':>14}: wall {capacity['wall_s']:6.1f} s  cpu {capacity['cpu_s']:6.1f} s")
    for name in [*names, "total"]:
        mine = [r for r in runs if r["policy"] == name]
        wall, cpu = (statistics.median(r[k] for r in mine) for k in ("wall_s", "cpu_s"))
        print(f"{name:>14}: wall {wall:6.1f} s  cpu {cpu:6.1f} s  (median of {len(mine)})")
    print(f"{len(workload)} requests; load average before {load_before[0]:.1f}, after {load_after[0]:.1f}")
    if FLAGS.doc_data:
        from cbjax.bench.doc_data import write_doc_data

        write_doc_data(
            FLAGS.doc_data,
            command=f"python -m experiments.bench_sim_speed {' '.join(sys.argv[1:])}",
            runs=runs,
            what="seconds of the simulator's runs (not the results files), per policy and per repeat, interleaved",
            num_requests=len(workload),
            capacity_run=capacity,
            load_average_before=list(load_before),
            load_average_after=list(load_after),
        )
        print(f"data: {FLAGS.doc_data}")


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=cp.parse_flags)
