"""The main job: the same workload through each scheduling policy on the same model; one table, one results folder.

  python -m experiments.compare_policies --config=configs/compare_cpu.py [--config.engine.max_num_seqs=16 ...]

Each entry of `config.policies` (an engine policy such as "fcfs", "static", "sarathi", "priority", ..., or the
client-side "time_window"; see cbjax.bench.online.plan_policy and docs/policies.md) gets its own engine,
warmed up before its run so no compile is timed (engines of the same shapes share jax's compile cache, so only the
first one compiles). Requests arrive by the workload's clock and join the engine as they arrive (cbjax.bench.online).
Prints one row per policy and the continuous/static output-throughput ratio, and writes results/<run_name>/:
config.json, manifest.json, summary.json, summary.csv, requests.jsonl, steps.jsonl and PNG plots
(cbjax/bench/results.py, cbjax/bench/plots.py). Ctrl-C stops the run and writes what was measured so far. How to read
it: docs/experiments.md.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import os
import sys
from collections.abc import Callable
from typing import Any

from absl import app, logging
from ml_collections import config_flags

from cbjax.bench.comparison_table import INTERVAL_METRICS, format_table, interval_table, outputs_line, ratio_line
from cbjax.bench.ctrl_c import CtrlC
from experiments.comparison_config import (
    DATA_PARALLEL_OPTIONS,
    engine_options,
    resolve_config,
)
from experiments.load_harness import (
    capacity_policy,
    capacity_runs,
    horizon_of,
    load_of,
    workload_config,
    workloads_at,
)

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_CONFIG = config_flags.DEFINE_config_file(
    "config",
    os.path.join(_ROOT, "configs", "compare_cpu.py"),
    "experiment config file; override any field with --config.<field>=<value>",
)


def prepare_run(cfg):
    """The resolved config and its workload: everything checked (a ValueError naming the problem) before the run
    writes a file or builds an engine. With workload.load the workload's requests are returned all at t=0: their
    arrival rate waits on the capacity `apply_load` measures."""
    from cbjax.bench.workload import make_workload

    cfg = resolve_config(cfg)
    return cfg, make_workload(workload_config(cfg, offline=load_of(cfg) is not None))


def measure_capacity(cfg, requests, *, progress: bool = True):
    """The reference policy's capacity (cbjax.bench.capacity.Capacity): `requests` all queued at t=0, on a fresh
    engine of the comparison's options, config.capacity.runs times, the same clock as the comparison."""
    from cbjax.bench.capacity import capacity_of, offline
    from cbjax.bench.metrics import summarize

    queued, summaries = offline(requests), []
    for _ in range(capacity_runs(cfg)):
        _, res = run_once(cfg, capacity_policy(cfg), queued, desc=f"capacity {capacity_policy(cfg)}", progress=progress)
        if res.interrupted:  # Ctrl-C while measuring: no capacity, so no comparison either
            raise KeyboardInterrupt
        summaries.append(summarize(res.requests, res.steps))
    return capacity_of(capacity_policy(cfg), summaries, len(queued))


@dataclasses.dataclass
class Comparison:
    results: dict[str, Any]  # policy -> cbjax.bench.online.OnlineResult of its first repeat
    engines: dict[str, dict[str, Any]]  # policy -> engine config, bucket table, warmup time (for the manifest)
    num_requests: int
    interrupted: bool = False
    # policy -> its OnlineResult of every repeat, in repeat order (config.repeats; the first is results[policy])
    repeats: dict[str, list[Any]] = dataclasses.field(default_factory=dict)
    capacity: Any = None  # cbjax.bench.capacity.Capacity the workload's rate was set from (config.workload.load)
    load: float | None = None

    def load_line(self) -> str | None:
        """The load, the capacity it is relative to and the resulting rate; None for an absolute rate."""
        return None if self.capacity is None else self.capacity.header(self.load)

    @property
    def num_repeats(self) -> int:
        """Repeats completed by every policy that ran."""
        return min((len(r) for r in self.repeats.values()), default=0)


def build_engine(model, clock, options: dict):
    """An LLMEngine, or a DataParallelEngine when the options ask for more than one replica."""
    from cbjax.data_parallel import DataParallelEngine
    from cbjax.engine import LLMEngine

    dp = {k: options[k] for k in DATA_PARALLEL_OPTIONS if options.get(k) is not None}
    engine_options = {k: v for k, v in options.items() if k not in DATA_PARALLEL_OPTIONS}
    if dp.get("data_parallel_size", 1) == 1 and set(dp) <= {"data_parallel_size"}:
        return LLMEngine(model, clock=clock, **engine_options)
    return DataParallelEngine(model, clock=clock, **dp, **engine_options)


def run_once(cfg, name: str, workload, *, desc: str, progress: bool = True, horizon_s=None, on_step=None, stop=None):
    """Entry `name` on a fresh engine of the config's options and clock, through `workload` (cbjax.bench.online):
    (the engine's facts for the manifest, the OnlineResult; None when `stop()` said so once the engine was built).
    The comparison's runs and the capacity runs both come here, so they share the clock, the step cost and the
    engine options."""
    from tqdm import tqdm

    from cbjax.bench.online import run_online
    from cbjax.core.clock import RealClock, VirtualClock

    plan, options = engine_options(cfg, name)
    logging.info("%s: engine policy=%s static_batch_timeout_s=%s, client=%s", desc, options["policy"],
                 options["static_batch_timeout_s"], plan.client)  # fmt: skip
    engine = build_engine(cfg.model, VirtualClock() if cfg.clock == "virtual" else RealClock(), options)
    facts = {
        "config": engine.config.options(),
        "buckets": dataclasses.asdict(engine.buckets),
        "client": None if plan.client is None else dataclasses.asdict(plan.client),
        "warmup_s": engine.warmup_s,
        "compiles_at_warmup": engine.num_compiles,
    }
    if options.get("runner") == "sim":  # what the step times are: a fit or a prediction
        facts["cost_model"] = engine.runner.cost_model.to_dict()
    if stop is not None and stop():  # e.g. Ctrl-C while the engine was being built
        return facts, None
    bar = tqdm(total=len(workload), desc=f"{desc:>11}", unit="req", disable=not progress, file=sys.stderr)

    def step_done(p):
        bar.update(p.num_finished - bar.n)
        if on_step is not None:
            on_step(p)

    step_cost_s = cfg.step_cost_ms / 1e3 if cfg.step_cost_ms > 0 else None  # None: each step's measured time
    try:
        result = run_online(engine, workload, client=plan.client, step_cost_s=step_cost_s, on_step=step_done,
                            horizon_s=horizon_s)  # fmt: skip
    finally:
        bar.close()
    return facts, result


def _run_entry(cfg, comp: Comparison, name: str, rep: int, workload, ctrl_c, progress, on_step) -> bool:
    """One run of entry `name` (repeat `rep`), kept in `comp`. False when the run was stopped."""

    def step_done(p):
        if on_step is not None:
            on_step(name, p)
        if ctrl_c.pressed:
            raise KeyboardInterrupt  # run_online ends the run here, keeping what it measured

    label = name if cfg.get("repeats", 1) * cfg.get("seeds", 1) == 1 else f"{name} #{rep + 1}"
    facts, result = run_once(cfg, name, workload, desc=label, progress=progress, horizon_s=horizon_of(cfg, workload),
                             on_step=step_done, stop=lambda: ctrl_c.pressed)  # fmt: skip
    if result is None:
        comp.interrupted = True
        return False
    comp.engines.setdefault(name, facts)
    comp.results.setdefault(name, result)
    comp.repeats.setdefault(name, []).append(result)
    if result.interrupted:
        comp.interrupted = True
        return False
    return True


def run_comparison(cfg, *, workload=None, progress: bool = True, on_step: Callable | None = None) -> Comparison:
    """Run every policy of the (resolved) config on the same workload (None: the config's). Ctrl-C ends it early
    with what was measured.

    `on_step(policy, Progress)` is called after every engine step (tests use it to inject an interrupt).
    With config.repeats > 1 every policy runs that many times, interleaved, on each of config.seeds workload seeds
    (see `comp.repeats`: run i of every policy had the same workload). With config.workload.load the capacity is
    measured first (`measure_capacity`) and `workload`, if given, holds the requests (their arrival times unused)."""
    from cbjax.bench.workload import make_workload

    capacity, load, rate = None, load_of(cfg), None
    if load is not None:  # the requests are the load's; their arrival times follow the measured capacity
        requests = workload if workload is not None else make_workload(workload_config(cfg, offline=True))
        capacity = measure_capacity(cfg, requests, progress=progress)
        rate, workload = capacity.rate_at(load), None
    workloads = workloads_at(cfg, seeds=cfg.get("seeds", 1), request_rate=rate, first=workload)
    comp = Comparison({}, {}, len(workloads[0]), capacity=capacity, load=load)
    with CtrlC("stopping at the next step, then writing what was measured") as ctrl_c:
        try:
            for run in range(cfg.get("repeats", 1) * len(workloads)):
                # Interleaved: each run goes through every policy once, starting one entry later than the run before,
                # so a slow minute of the machine falls on all of them and no policy always runs first.
                k = run % len(cfg.policies)
                wl = workloads[run % len(workloads)]
                for name in cfg.policies[k:] + cfg.policies[:k]:
                    if not _run_entry(cfg, comp, name, run, wl, ctrl_c, progress, on_step):
                        return comp
        except KeyboardInterrupt:  # a second Ctrl-C: keep the policies already measured
            comp.interrupted = True
    return comp


def run_summaries(cfg, comp: Comparison, name: str) -> list[dict[str, Any]]:
    """cbjax.bench.metrics.summarize of each run of entry `name` that every policy completed, plus its run facts."""
    from cbjax.bench.metrics import summarize

    slo = {k: v for k, v in cfg.slo.to_dict().items() if v is not None}
    out = []
    for res in comp.repeats.get(name, [comp.results[name]])[: max(comp.num_repeats, 1)]:
        s = summarize(res.requests, res.steps, slo=slo)
        s.update(interrupted=res.interrupted, num_not_arrived=res.num_not_arrived, wall_s=res.wall_s,
                 warmup_s=comp.engines[name]["warmup_s"])  # fmt: skip
        out.append(s)
    return out


def summaries_of(cfg, comp: Comparison) -> dict[str, dict[str, Any]]:
    """cbjax.bench.metrics.summarize per policy, plus run facts and each policy's output throughput over static's.
    With several repeats, the metrics of INTERVAL_METRICS are medians over the repeats that every policy completed,
    with 95% intervals and, given config.baseline, paired ratios to the baseline (cbjax/bench/intervals.py)."""
    from cbjax.bench.intervals import summarize_repeats

    if comp.num_repeats < 2:
        out = {name: run_summaries(cfg, comp, name)[0] for name in comp.results}
    else:
        runs = {name: run_summaries(cfg, comp, name) for name in comp.results}
        baseline = runs.get(cfg.get("baseline"))
        out = {name: summarize_repeats(r, INTERVAL_METRICS, baseline) for name, r in runs.items()}
    base = out.get("static", {}).get("output_throughput", math.nan)
    for s in out.values():
        s["output_throughput_vs_static"] = s["output_throughput"] / base if base and base > 0 else math.nan
        s["swap_mb"] = (s["swap_out_bytes"] + s["swap_in_bytes"]) / 2**20
    # Greedy decoding: every policy must generate the same tokens. Compared with the first entry, over the
    # requests both completed.
    if comp.results:
        first = next(iter(comp.results.values())).output_token_ids
        for name, res in comp.results.items():
            both = [rid for rid in res.output_token_ids if rid in first]
            same = sum(res.output_token_ids[rid] == first[rid] for rid in both)
            out[name]["same_outputs"] = same / len(both) if both else math.nan
            out[name]["num_compared_outputs"] = len(both)
    return out


def write_results(comp: Comparison, summaries, folder: str, start_time: datetime.datetime) -> list[str]:
    """manifest.json, summary.json/csv, requests.jsonl, steps.jsonl and the plots into `folder`."""
    from cbjax.bench import plots, results

    results.write_json(
        os.path.join(folder, "manifest.json"),
        results.manifest(
            start_time=start_time,
            engines=comp.engines,
            extra={
                "interrupted": comp.interrupted,
                "num_requests": comp.num_requests,
                "policies_run": list(comp.results),
                "repeats": comp.num_repeats,  # runs of every policy (repeats x seeds, run i on seed i % seeds)
                # workload.load: the reference policy's offline capacity measured before the runs, and the rate
                "load": None if comp.capacity is None else comp.capacity.to_dict(comp.load),
            },
        ),
    )
    results.write_summary(folder, summaries)
    results.write_records(folder, comp.repeats or {name: [res] for name, res in comp.results.items()})
    return plots.plot_all(folder, summaries, comp.results) if comp.results else []


def write_doc_data_of(cfg, comp: Comparison, path: str, argv: list[str], load_average_before) -> None:
    """config.doc_data: a data file for the docs (cbjax/bench/doc_data.py): one run per (policy, run) with every
    metric of its summary, the run's workload seed, the load and the resolved config; the docs' tables are made
    from it by `python -m experiments.doc_tables`."""
    from cbjax.bench.doc_data import write_doc_data

    seeds = cfg.get("seeds", 1)
    load = None if comp.capacity is None else comp.capacity.to_dict(comp.load)
    runs = [  # the load in every run too, so a table of runs can show it (columns "load.load", ...)
        {"policy": name, "run": i + 1, "seed": cfg.workload.seed + i % seeds, "load": load, **summary}
        for name in comp.results
        for i, summary in enumerate(run_summaries(cfg, comp, name))
    ]
    write_doc_data(
        path,
        command=" ".join(["python -m experiments.compare_policies", *argv[1:]]),
        runs=runs,
        load=load,
        interrupted=comp.interrupted,
        load_average_before=load_average_before,
        load_average_after=list(os.getloadavg()),
        config=cfg.to_dict(),
    )
    print(f"data for the docs: {path}")


def _unloadable(e: OSError) -> ValueError:
    # ml_collections lists every path it tried; the last line says why the file could not be loaded.
    reason = [line.strip() for line in str(e).splitlines() if line.strip()][-1]
    return ValueError(f"cannot load the --config file: {reason}")


def load_config():
    """The --config file's config; a file that cannot be loaded is a ValueError of one line, not a traceback."""
    try:
        config = _CONFIG.value
        config.get("model")  # a file that failed to load gives a stand-in that raises on first use
        return config
    except OSError as e:
        raise _unloadable(e) from None


def parse_flags(argv):
    """absl's flag parsing, with a config file that cannot be loaded (seen while parsing --config.<field>
    overrides) reported in one line."""
    try:
        return app.parse_flags_with_usage(argv)
    except OSError as e:
        sys.exit(f"compare_policies: {_unloadable(e)}")


def main(argv):
    del argv
    from cbjax.bench import results

    start_time = datetime.datetime.now().astimezone()
    try:
        cfg, workload = prepare_run(load_config())
    except ValueError as e:
        sys.exit(f"compare_policies: {e}")  # one line on stderr, exit status 1, nothing written
    folder = results.run_dir(cfg.output_dir, cfg.run_name, overwrite=cfg.get("overwrite", False))
    if os.path.basename(folder) != cfg.run_name:
        print(f"{os.path.join(cfg.output_dir, cfg.run_name)} holds an earlier run: writing to {folder} instead")
    results.write_config(os.path.join(folder, "config.json"), cfg)
    load_average_before = list(os.getloadavg())
    comp = run_comparison(cfg, workload=workload)
    with CtrlC("writing what was measured first"):
        summaries = summaries_of(cfg, comp)
        print()
        if comp.load_line() is not None:
            print(comp.load_line())
        print(format_table(summaries))
        for line in (interval_table(summaries, cfg.get("baseline")), ratio_line(summaries), outputs_line(summaries)):
            if line is not None:
                print(line)
        write_results(comp, summaries, folder, start_time)
        if cfg.get("doc_data") and comp.results:
            write_doc_data_of(cfg, comp, cfg.doc_data, sys.argv, load_average_before)
    if comp.interrupted:
        print(f"interrupted: {len(comp.results)} of {len(cfg.policies)} policies measured (the last one partly)")
    print(f"results: {folder}")


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
