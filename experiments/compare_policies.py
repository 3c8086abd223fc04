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

from cbjax.bench.capacity import check_load
from cbjax.bench.comparison_table import INTERVAL_METRICS, format_table, interval_table, outputs_line, ratio_line
from cbjax.bench.ctrl_c import CtrlC

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_CONFIG = config_flags.DEFINE_config_file(
    "config",
    os.path.join(_ROOT, "configs", "compare_cpu.py"),
    "experiment config file; override any field with --config.<field>=<value>",
)


def entry_plan(cfg, name: str):
    """The PolicyPlan of one entry of `config.policies`, and the engine options it overrides.

    An entry is a policy name (cbjax.bench.online.plan_policy) or a label of `config.variants`, whose value names the
    policy and overrides engine options: variants.cache_on = dict(policy="fcfs", enable_prefix_caching=True).
    `config.policy_options[entry]` holds the policy's constructor options."""
    from cbjax.bench.online import plan_policy
    from cbjax.engine_config import EngineConfig

    variant = _plain((cfg.get("variants") or {}).get(name) or {})
    policy = variant.pop("policy", name)
    known = set(EngineConfig.option_defaults()) | {*DATA_PARALLEL_OPTIONS}
    unknown = sorted(set(variant) - known)
    if unknown:
        raise ValueError(f"config.variants.{name}: unknown engine option(s) {unknown}")
    options = (cfg.get("policy_options") or {}).get(name)
    plan = plan_policy(
        policy,
        static_batch_timeout_s=cfg.engine.static_batch_timeout_s,
        window_ms=cfg.time_window.window_ms,
        max_batch=cfg.time_window.max_batch,
        policy_options=None if options is None else _plain(options),
    )
    return plan, variant


def engine_options(cfg, name: str):
    """The PolicyPlan of one entry and its engine's options: config.engine, the entry's policy and variant, and
    (with engine.runner="sim") config.sim's cost model."""
    plan, overrides = entry_plan(cfg, name)
    options = {**cfg.engine.to_dict(), **plan.engine_options, **overrides}
    if options.get("runner") == "sim":
        sim = cfg.get("sim") or {}
        options.update(
            sim_profile=sim.get("profile"),
            sim_accelerator=sim.get("accelerator"),
            sim_num_chips=sim.get("num_chips", 1),
            sim_step_time_scale=sim.get("step_time_scale", 1.0),
        )
    return plan, options


def _check_sim(cfg) -> None:
    """A simulated run: a virtual clock, its step times from exactly one of config.sim.profile (a readable
    cost-model profile, or "auto": this machine's cached calibration, made by the first engine if there is none)
    and config.sim.accelerator."""
    from cbjax.sim import AUTO_PROFILE, load_profile

    if cfg.engine.get("runner", "model") != "sim":
        return
    if cfg.clock != "virtual" or cfg.step_cost_ms != 0:
        raise ValueError("config.engine.runner='sim' needs config.clock='virtual' and config.step_cost_ms=0")
    sim = cfg.get("sim") or {}
    if (sim.get("profile") is None) == (sim.get("accelerator") is None):
        raise ValueError("config.engine.runner='sim' needs exactly one of config.sim.profile, config.sim.accelerator")
    if sim.get("profile") not in (None, AUTO_PROFILE):
        load_profile(sim["profile"])  # readable, and a known kind of cost model


def _plain(d) -> dict:
    """A ConfigDict (nested ones too) as plain dicts: engine configs go into the JSON manifest."""
    return d.to_dict() if hasattr(d, "to_dict") else dict(d)


def resolve_config(cfg):
    """Fill what the config leaves to the run (vocabulary, clipping length) and check the policy list.

    `policies` may hold comma-separated entries (`--config.policies=fcfs,static` arrives as one string).
    `engine.policy`, when set (`--config.engine.policy=sjf`), runs that one policy instead of the list."""
    from cbjax.core.policy_zoo import make_policy
    from cbjax.engine_config import EngineConfig
    from cbjax.model.registry import model_config_of

    cfg = cfg.copy_and_resolve_references()
    single = cfg.engine.get("policy")
    if "policy" in cfg.engine:
        with cfg.unlocked():
            del cfg.engine["policy"]  # each entry of `policies` sets the engine's policy
    if single is not None:
        cfg.policies = (single,)
    names = [p.strip() for entry in cfg.policies for p in str(entry).split(",") if p.strip()]
    if not names:
        raise ValueError("config.policies is empty")
    if len(set(names)) != len(names):
        raise ValueError(f"config.policies lists a policy twice: {names}")
    for name in names:
        # An unknown name, variant field or policy option fails here, before any compile.
        plan, _ = entry_plan(cfg, name)
        if "policy_options" in plan.engine_options:
            make_policy(plan.engine_options["policy"], plan.engine_options["policy_options"])
    unused = sorted(set(cfg.get("policy_options") or {}) - set(names))
    if unused:
        raise ValueError(f"config.policy_options names policies not in config.policies: {unused}")
    cfg.policies = tuple(names)
    for field in ("horizon_s", "horizon_after_last_arrival_s"):
        if cfg.get(field) is not None and not cfg[field] > 0:
            raise ValueError(f"config.{field} must be > 0 or None, got {cfg[field]}")
    if cfg.clock not in ("real", "virtual"):
        raise ValueError(f"config.clock must be 'real' or 'virtual', got {cfg.clock!r}")
    if cfg.step_cost_ms < 0 or (cfg.step_cost_ms > 0 and cfg.clock != "virtual"):
        raise ValueError(f"config.step_cost_ms={cfg.step_cost_ms} needs config.clock='virtual' (0 with a real clock)")
    for field in ("repeats", "seeds"):
        value = cfg.get(field, 1)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"config.{field} must be an integer >= 1, got {value!r}")
    if cfg.get("baseline") is not None and cfg.baseline not in names:
        raise ValueError(f"config.baseline ({cfg.baseline!r}) is not one of config.policies {names}")
    if not isinstance(cfg.get("overwrite", False), bool):
        raise ValueError(f"config.overwrite must be True or False, got {cfg.overwrite!r}")
    _check_sim(cfg)
    model_config = model_config_of(cfg.model)
    for name in names:  # every entry's engine options, as its engine will get them
        options = engine_options(cfg, name)[1]
        try:
            check_data_parallel(options)
            EngineConfig.from_options({k: v for k, v in options.items() if k not in DATA_PARALLEL_OPTIONS})
        except ValueError as e:
            raise ValueError(f"config.engine (entry {name!r}): {e}") from None
    load = load_of(cfg)
    if load is not None:
        entry_plan(cfg, capacity_policy(cfg))  # an unknown reference policy fails here, before any compile
        if cfg.workload.get("request_rate") is not None:
            logging.warning(
                "workload.load=%s sets the arrival rate: workload.request_rate=%s is not used "
                "(--config.workload.load=0 to use it)",
                load,
                cfg.workload.request_rate,
            )
    if cfg.workload.vocab_size is None:
        cfg.workload.vocab_size = model_config.vocab_size
    if cfg.workload.max_model_len is None and cfg.engine.max_model_len is not None:
        cfg.workload.max_model_len = cfg.engine.max_model_len
    return cfg


def check_data_parallel(options: dict) -> None:
    """The data-parallel options of an entry (ValueError naming the problem)."""
    from cbjax.config import validation as check
    from cbjax.core.routers import make_router

    if options.get("data_parallel_size") is not None:
        check.integer("data_parallel_size", options["data_parallel_size"], 1)
    if options.get("router") is not None or options.get("router_options") is not None:
        make_router(options.get("router") or "least_load", _plain(options.get("router_options") or {}))


def prepare_run(cfg):
    """The resolved config and its workload: everything checked (a ValueError naming the problem) before the run
    writes a file or builds an engine. With workload.load the workload's requests are returned all at t=0: their
    arrival rate waits on the capacity `apply_load` measures."""
    from cbjax.bench.workload import make_workload

    cfg = resolve_config(cfg)
    return cfg, make_workload(workload_config(cfg, offline=load_of(cfg) is not None))


def workload_config(cfg, *, seed_offset: int = 0, offline: bool = False):
    """The fields of cbjax.bench.workload.make_workload from config.workload: its seed moved by `seed_offset`,
    without `load` (that is the harness's, resolved into request_rate by `apply_load`); `offline`: all at t=0."""
    w = cfg.workload.copy_and_resolve_references()
    with w.unlocked():
        w.seed = cfg.workload.seed + seed_offset
        if "load" in w:
            del w["load"]
        if offline:
            w.arrival, w.request_rate = "offline", None
    return w


def load_of(cfg) -> float | None:
    """config.workload.load, checked; None when the workload's request_rate is absolute (load None or 0)."""
    return check_load(cfg.workload.get("load"), cfg.workload.get("arrival"))


def capacity_policy(cfg) -> str:
    """The entry whose offline capacity a workload.load is relative to (config.capacity.policy, default fcfs)."""
    return (cfg.get("capacity") or {}).get("policy", "fcfs")


def measure_capacity(cfg, requests, *, progress: bool = True):
    """The reference policy's capacity (cbjax.bench.capacity.Capacity): `requests` all queued at t=0, on a fresh
    engine of the comparison's options, config.capacity.runs times (default 1), the same clock as the comparison."""
    from tqdm import tqdm

    from cbjax.bench.capacity import capacity_of, offline
    from cbjax.bench.metrics import summarize
    from cbjax.bench.online import run_online
    from cbjax.core.clock import RealClock, VirtualClock

    name = capacity_policy(cfg)
    plan, options = engine_options(cfg, name)
    step_cost_s = cfg.step_cost_ms / 1e3 if cfg.step_cost_ms > 0 else None
    queued = offline(requests)
    summaries = []
    for _ in range(int((cfg.get("capacity") or {}).get("runs", 1))):
        engine = build_engine(cfg.model, VirtualClock() if cfg.clock == "virtual" else RealClock(), options)
        bar = tqdm(total=len(queued), desc=f"capacity {name}", unit="req", disable=not progress, file=sys.stderr)
        res = run_online(engine, queued, client=plan.client, step_cost_s=step_cost_s,
                         on_step=lambda p, bar=bar: bar.update(p.num_finished - bar.n))  # fmt: skip
        bar.close()
        del engine  # free its KV cache before the next engine is built
        if res.interrupted:  # Ctrl-C while measuring: no capacity, so no comparison either
            raise KeyboardInterrupt
        summaries.append(summarize(res.requests, res.steps))
    return capacity_of(name, summaries, len(queued))


def apply_load(cfg, requests, *, progress: bool = True):
    """With config.workload.load: measure the reference policy's capacity on `requests` and set the workload's
    request_rate to load x capacity. Returns (config, the workload to run, Capacity or None)."""
    from cbjax.bench.workload import make_workload

    load = load_of(cfg)
    if load is None:
        return cfg, requests, None
    capacity = measure_capacity(cfg, requests, progress=progress)
    cfg = cfg.copy_and_resolve_references()
    cfg.workload.request_rate = capacity.rate_at(load)
    cfg.workload.load = 0.0  # applied: the rate is now absolute
    return cfg, make_workload(workload_config(cfg)), capacity


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


# Not engine options: they make a data-parallel engine (cbjax/data_parallel.py) of replicas behind a router.
DATA_PARALLEL_OPTIONS = ("data_parallel_size", "router", "router_options")


def build_engine(model, clock, options: dict):
    """An LLMEngine, or a DataParallelEngine when the options ask for more than one replica."""
    from cbjax.data_parallel import DataParallelEngine
    from cbjax.engine import LLMEngine

    dp = {k: options[k] for k in DATA_PARALLEL_OPTIONS if options.get(k) is not None}
    engine_options = {k: v for k, v in options.items() if k not in DATA_PARALLEL_OPTIONS}
    if dp.get("data_parallel_size", 1) == 1 and set(dp) <= {"data_parallel_size"}:
        return LLMEngine(model, clock=clock, **engine_options)
    return DataParallelEngine(model, clock=clock, **dp, **engine_options)


def _run_entry(cfg, comp: Comparison, name: str, rep: int, workload, step_cost_s, ctrl_c, progress, on_step) -> bool:
    """One run of entry `name` (repeat `rep`) on a fresh engine, kept in `comp`. False when the run was stopped."""
    from tqdm import tqdm

    from cbjax.bench.online import run_online
    from cbjax.core.clock import RealClock, VirtualClock

    plan, options = engine_options(cfg, name)
    clock = VirtualClock() if cfg.clock == "virtual" else RealClock()
    logging.info(
        "%s: engine policy=%s static_batch_timeout_s=%s, client=%s (repeat %d)",
        name,
        options["policy"],
        options["static_batch_timeout_s"],
        plan.client,
        rep,
    )
    engine = build_engine(cfg.model, clock, options)
    if ctrl_c.pressed:  # while it was being built
        comp.interrupted = True
        return False
    if name not in comp.engines:
        comp.engines[name] = {
            "config": engine.config.options(),
            "buckets": dataclasses.asdict(engine.buckets),
            "client": None if plan.client is None else dataclasses.asdict(plan.client),
            "warmup_s": engine.warmup_s,
            "compiles_at_warmup": engine.num_compiles,
        }
        if options.get("runner") == "sim":  # what the step times are: a fit or a prediction
            comp.engines[name]["cost_model"] = engine.runner.cost_model.to_dict()
    label = name if cfg.get("repeats", 1) * cfg.get("seeds", 1) == 1 else f"{name} #{rep + 1}"
    bar = tqdm(total=len(workload), desc=f"{label:>11}", unit="req", disable=not progress, file=sys.stderr)

    def step_done(p):
        bar.update(p.num_finished - bar.n)
        if on_step is not None:
            on_step(name, p)
        if ctrl_c.pressed:
            raise KeyboardInterrupt  # run_online ends the run here, keeping what it measured

    result = run_online(
        engine,
        workload,
        client=plan.client,
        step_cost_s=step_cost_s,
        on_step=step_done,
        horizon_s=horizon_of(cfg, workload),
    )
    bar.close()
    comp.results.setdefault(name, result)
    comp.repeats.setdefault(name, []).append(result)
    del engine  # free its KV cache before the next entry's engine is built
    if result.interrupted:
        comp.interrupted = True
        return False
    return True


def horizon_of(cfg, workload) -> float | None:
    """When each run ends (s from the start): config.horizon_s, or config.horizon_after_last_arrival_s after the
    workload's last arrival (a load sets the arrival span, so a fixed horizon would cut a different share of the
    run on another machine), the earlier of the two when both are set; None: when every request has finished."""
    ends = [cfg.get("horizon_s")]
    if cfg.get("horizon_after_last_arrival_s") is not None and workload:
        ends.append(max(r.arrival_time for r in workload) + cfg.horizon_after_last_arrival_s)
    ends = [e for e in ends if e is not None]
    return min(ends) if ends else None


def run_comparison(cfg, *, workload=None, progress: bool = True, on_step: Callable | None = None) -> Comparison:
    """Run every policy of the (resolved) config on the same workload (None: the config's). Ctrl-C ends it early
    with what was measured.

    `on_step(policy, Progress)` is called after every engine step (tests use it to inject an interrupt).
    With config.repeats > 1 every policy runs that many times, interleaved, on each of config.seeds workload seeds
    (see `comp.repeats`: run i of every policy had the same workload). With config.workload.load the capacity is
    measured first (`apply_load`) and `workload`, if given, holds the requests (their arrival times unused)."""
    from cbjax.bench.workload import make_workload

    capacity, load = None, load_of(cfg)
    if load is not None:
        requests = workload if workload is not None else make_workload(workload_config(cfg, offline=True))
        cfg, workload, capacity = apply_load(cfg, requests, progress=progress)
    seeds = cfg.get("seeds", 1)
    workloads = [
        workload if workload is not None and s == 0 else make_workload(workload_config(cfg, seed_offset=s))
        for s in range(seeds)
    ]
    comp = Comparison({}, {}, len(workloads[0]), capacity=capacity, load=load)
    step_cost_s = cfg.step_cost_ms / 1e3 if cfg.step_cost_ms > 0 else None  # None: measured
    with CtrlC("stopping at the next step, then writing what was measured") as ctrl_c:
        try:
            for run in range(cfg.get("repeats", 1) * seeds):
                # Interleaved: each run goes through every policy once, starting one entry later than the run before,
                # so a slow minute of the machine falls on all of them and no policy always runs first.
                k = run % len(cfg.policies)
                wl = workloads[run % seeds]
                for name in cfg.policies[k:] + cfg.policies[:k]:
                    if not _run_entry(cfg, comp, name, run, wl, step_cost_s, ctrl_c, progress, on_step):
                        return comp
        except KeyboardInterrupt:  # a second Ctrl-C: keep the policies already measured
            comp.interrupted = True
    return comp


def summaries_of(cfg, comp: Comparison) -> dict[str, dict[str, Any]]:
    """cbjax.bench.metrics.summarize per policy, plus run facts and each policy's output throughput over static's.
    With several repeats, the metrics of INTERVAL_METRICS are medians over the repeats that every policy completed,
    with 95% intervals and, given config.baseline, paired ratios to the baseline (cbjax/bench/intervals.py)."""
    from cbjax.bench.intervals import summarize_repeats
    from cbjax.bench.metrics import summarize

    slo = {k: v for k, v in cfg.slo.to_dict().items() if v is not None}

    def summary(name, res):
        s = summarize(res.requests, res.steps, slo=slo)
        s.update(
            interrupted=res.interrupted,
            num_not_arrived=res.num_not_arrived,
            wall_s=res.wall_s,
            warmup_s=comp.engines[name]["warmup_s"],
        )
        return s

    n = comp.num_repeats
    if n < 2:
        out = {name: summary(name, res) for name, res in comp.results.items()}
    else:
        runs = {name: [summary(name, r) for r in comp.repeats[name][:n]] for name in comp.results}
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
    if comp.interrupted:
        print(f"interrupted: {len(comp.results)} of {len(cfg.policies)} policies measured (the last one partly)")
    print(f"results: {folder}")


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
