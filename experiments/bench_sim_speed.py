"""How fast the simulator runs a compare_policies config: per policy, the wall and CPU seconds of the simulated run
(engine, scheduler, policy, cost model; not the results files), the median of --repeats runs.

  python -m experiments.bench_sim_speed --config=configs/sim_zoo.py [--repeats=3] [--policies=fcfs,static] \\
      [--jobs=2] [--doc_data=docs/data/sim_speed_DATE.json]
  python -m experiments.bench_sim_speed --merge=A.json,B.json,C.json --sitting="COMMANDS" --doc_data=OUT.json

The repeats are interleaved: each goes through every policy once, starting one policy later than the repeat
before, so a slow minute of a shared machine falls on all of them. With `workload.load` the capacity run that sets
the arrival rate is made once, before the timed runs, and timed on its own (`capacity`). A repeat's `total` is the
wall time of all its policies' runs, timed as one. CPU seconds are this process's (time.process_time): on a shared
machine they move much less with the other jobs' load than wall seconds, which is why both are kept, with the load
average before and after every run. --doc_data writes every run (cbjax/bench/doc_data.py) for the docs' tables.

--merge combines the --doc_data files of --repeats=1 invocations into one (a sitting that alternates the previous
tree and this one, a process each, repeat by repeat), `run` numbered by the file's place in the list.

--jobs=N runs a repeat's entries in N worker processes at once (spawned after the capacity run, handed the config
and the workload once, and warmed up on its first 100 requests; their start is not timed). Each entry is still one
engine in one process, so it decides and generates the same (tests/sim/test_harness.py compares the tokens). An
entry's seconds are then its worker's, and a repeat's `total` is the wall time of the whole repeat, its CPU seconds
the sum over its entries. The one-process figure (--jobs=1) is the primary one: --jobs=2 on 2 cores gains only
while nothing else runs.
"""

import multiprocessing
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
    flags.DEFINE_integer("jobs", 1, "worker processes running a repeat's entries at once (1: this process only)")
    flags.DEFINE_string("doc_data", None, "also write a data file for the docs (every run, raw) to this path")
    flags.DEFINE_list("merge", None, "instead of running: the --doc_data files of single-repeat invocations, merged")
    flags.DEFINE_string("sitting", None, "with --merge: the sitting's commands (the merged file's `command`)")


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


def run_entry(cfg, workload, name: str, rep: int) -> dict:
    """One timed run of entry `name` on `workload`: its record."""
    with cfg.unlocked():
        cfg.policies = (name,)
    comp, t = _timed(lambda: cp.run_comparison(cfg, workload=workload, progress=False))
    tokens = sum(len(ids) for ids in comp.results[name].output_token_ids.values())
    print(f"run {rep + 1} {name:>14}: wall {t['wall_s']:6.1f} s  cpu {t['cpu_s']:6.1f} s", flush=True)
    return dict(policy=name, run=rep + 1, **t, generated_tokens=tokens)


_WORKER: tuple = ()  # (cfg, workload) in a worker process of --jobs


def _worker_init(cfg, workload, warm_name: str) -> None:
    """Hold the config and workload, and warm up as this process did in the capacity run (lazy imports, the
    profile, caches), on a short prefix of the workload, so a worker's first timed entry pays no more than the
    one-process runs do."""
    global _WORKER
    _WORKER = (cfg, workload)
    with cfg.unlocked():
        cfg.policies = (warm_name,)
    cp.run_comparison(cfg, workload=workload[:100], progress=False)


def _worker_entry(task: tuple[str, int]) -> dict:
    return run_entry(*_WORKER, *task)


def _pid_after_a_pause(_) -> int:
    time.sleep(0.2)  # long enough that a worker still starting up gets a task of its own
    return os.getpid()


def _started_pool(jobs: int, cfg, workload, warm_name: str):
    """A pool of `jobs` spawned workers (not forked: jax may run threads here), each warmed up (_worker_init)."""
    pool = multiprocessing.get_context("spawn").Pool(jobs, _worker_init, (cfg, workload, warm_name))
    for _ in range(100):  # until every worker has taken a task, so none still starts up during a timed repeat
        if len(set(pool.map(_pid_after_a_pause, range(jobs), 1))) == jobs:
            return pool
    pool.terminate()
    raise RuntimeError(f"{jobs} worker processes did not all start")


def bench(cfg, requests, names: list[str], repeats: int, jobs: int = 1) -> tuple[list[dict], dict | None]:
    """The timed runs of `requests` (compare_policies.prepare_run's workload): one record per (policy, repeat), plus
    one `total` per repeat; and the capacity run's record (None without a load). `jobs` > 1: each repeat's entries
    run in that many spawned worker processes."""
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs}")
    (cfg, workload, capacity), t = _timed(lambda: at_load(cfg, requests))
    cap_record = None if capacity is None else dict(t, **capacity)
    pool = None
    if jobs > 1:
        pool = _started_pool(jobs, cfg, workload, names[0])
    runs = []
    try:
        for rep in range(repeats):
            k = rep % len(names)
            order = names[k:] + names[:k]
            if pool is None:
                mine, t = _timed(lambda order=order, rep=rep: [run_entry(cfg, workload, n, rep) for n in order])
            else:
                mine, t = _timed(lambda order=order, rep=rep: pool.map(_worker_entry, [(n, rep) for n in order], 1))
                t["cpu_s"] = sum(r["cpu_s"] for r in mine)  # the workers' CPU seconds, not this idle parent's
            runs += mine
            runs.append(dict(policy="total", run=rep + 1, **t, jobs=jobs))
            print(f"run {rep + 1} {'total':>14}: wall {t['wall_s']:6.1f} s  cpu {t['cpu_s']:6.1f} s", flush=True)
    finally:
        if pool is not None:
            pool.close()
            pool.join()
    return runs, cap_record


def merge(paths: list[str], out: str, sitting: str) -> None:
    """One data file from the --doc_data files of --repeats=1 invocations (the repeats of a sitting that alternates
    two trees, each invocation a process of its own): every run kept, `run` renumbered by the file's place."""
    import json

    from cbjax.bench.doc_data import write_doc_data

    parts = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            parts.append(json.load(f))
    runs = [dict(r, run=k + 1) for k, part in enumerate(parts) for r in part["runs"]]
    keep = ("what", "num_requests", "jobs")
    write_doc_data(
        out,
        command=sitting,
        runs=runs,
        **{k: parts[0][k] for k in keep if k in parts[0]},
        merged_from=[
            dict(file=p, commit=part["commit"], dirty=part["dirty"], date=part["date"]) for p, part in zip(paths, parts)
        ],
        capacity_runs=[part.get("capacity_run") for part in parts],
        load_average_before=parts[0].get("load_average_before"),
        load_average_after=parts[-1].get("load_average_after"),
    )
    print(f"data: {out} ({len(runs)} runs from {len(parts)} files)")


def main(argv):
    del argv
    if FLAGS.merge:
        if not FLAGS.doc_data or not FLAGS.sitting:
            sys.exit("bench_sim_speed: --merge needs --doc_data (the merged file) and --sitting (its commands)")
        return merge(FLAGS.merge, FLAGS.doc_data, FLAGS.sitting)
    cfg = cp.load_config()
    names = FLAGS.policies or list(cfg.policies)
    only_entries(cfg, names)
    try:
        cfg, workload = cp.prepare_run(cfg)
    except ValueError as e:
        sys.exit(f"bench_sim_speed: {e}")
    load_before = os.getloadavg()
    runs, capacity = bench(cfg, workload, names, FLAGS.repeats, FLAGS.jobs)
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
            jobs=FLAGS.jobs,
            capacity_run=capacity,
            load_average_before=list(load_before),
            load_average_after=list(load_after),
        )
        print(f"data: {FLAGS.doc_data}")


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=cp.parse_flags)
