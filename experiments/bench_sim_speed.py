"""How fast the simulator runs a compare_policies config: per policy, the wall and CPU seconds of the simulated run
(engine, scheduler, policy, cost model; not the results files), the median of --repeats runs.

  python -m experiments.bench_sim_speed --config=configs/sim_zoo.py [--repeats=3] [--policies=fcfs,static]

CPU seconds are this process's (time.process_time): on a shared machine they move much less with the other jobs'
load than wall seconds, which is why both are printed, with the load average before and after.
"""

import os
import statistics
import time

from absl import app, flags

from experiments import compare_policies as cp  # defines --config

flags.DEFINE_integer("repeats", 3, "runs per policy (the median is reported)")
flags.DEFINE_list("policies", None, "a subset of config.policies (default: all)")
FLAGS = flags.FLAGS


def main(argv):
    del argv
    import ml_collections

    cfg = cp.load_config()
    names = FLAGS.policies or list(cfg.policies)
    with cfg.unlocked():
        cfg.policies = tuple(names)
        options = (cfg.get("policy_options") or {}).items()
        cfg.policy_options = ml_collections.ConfigDict({k: v for k, v in options if k in names})
    cfg, workload = cp.prepare_run(cfg)
    load_before = os.getloadavg()
    rows = {}
    for name in names:
        walls, cpus = [], []
        for _ in range(FLAGS.repeats):
            with cfg.unlocked():
                cfg.policies = (name,)
            t, c = time.perf_counter(), time.process_time()
            cp.run_comparison(cfg, workload=workload, progress=False)
            walls.append(time.perf_counter() - t)
            cpus.append(time.process_time() - c)
        rows[name] = (statistics.median(walls), statistics.median(cpus))
        print(f"{name:>14}: wall {rows[name][0]:6.1f} s  cpu {rows[name][1]:6.1f} s", flush=True)
    wall, cpu = sum(w for w, _ in rows.values()), sum(c for _, c in rows.values())
    print(f"{'total':>14}: wall {wall:6.1f} s  cpu {cpu:6.1f} s  ({len(workload)} requests, {FLAGS.repeats} runs each)")
    print(f"load average before {load_before[0]:.1f}, after {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    app.run(main, flags_parser=cp.parse_flags)
