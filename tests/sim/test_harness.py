"""The experiment harness on the simulator: the sim settings are checked before anything runs, and the load sweep
draws latency against load from the same runs compare_policies makes."""

import pytest

from experiments import bench_sim_speed, sim_sweep
from experiments import compare_policies as cp
from tests.helpers import parse_config

SIM = ["--config.engine.runner=sim", "--config.clock=virtual", "--config.sim.accelerator=h200"]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["--config.engine.runner=sim", "--config.sim.accelerator=h200"], "clock='virtual'"),
        (["--config.engine.runner=sim", "--config.clock=virtual"], "exactly one of"),
        ([*SIM, "--config.sim.profile=/no/such/profile.json"], "exactly one of"),
        (["--config.engine.runner=sim", "--config.clock=virtual", "--config.sim.profile=/no/such.json"], "cannot read"),
        ([*SIM, "--config.sim.num_chips=0"], "sim_num_chips"),
        (["--config.engine.runner=gpu"], "runner must be one of"),
    ],
)
def test_sim_settings_are_checked_before_the_run(overrides, message):
    with pytest.raises(ValueError, match=message):
        cp.resolve_config(parse_config(overrides))


def _small_sweep(overrides):
    cfg = parse_config(["--config.policies=fcfs", "--config.workload.num_requests=80", *overrides],
                       "configs/sim_sweep.py")  # fmt: skip
    with cfg.unlocked():
        cfg.policy_options = {}
    kind, points = sim_sweep.points_of(cfg)
    cfg, _ = cp.prepare_run(cfg)
    return sim_sweep.sweep(cfg, kind, points)


def test_the_sweep_draws_latency_against_load():
    rows, capacity = _small_sweep(["--config.sweep.loads=", "--config.sweep.rates=8,80", "--config.seeds=1"])
    assert capacity is None
    assert [(r["rate"], r["policy"], r["load"]) for r in rows] == [(8.0, "fcfs", None), (80.0, "fcfs", None)]
    low, high = rows
    assert low["num_completed"] == high["num_completed"] == 80
    assert high["ttft_ms_p99"] > low["ttft_ms_p99"]  # 80/s is well above what the profile serves (~50/s)
    assert high["wall_s"] < 30


def test_the_sweep_over_loads_is_relative_to_fcfs_capacity():
    rows, capacity = _small_sweep(["--config.sweep.loads=0.5,2", "--config.seeds=2"])
    assert capacity["policy"] == "fcfs" and capacity["capacity_request_rate"] > 0
    assert [(r["load"], r["run"], r["seed"]) for r in rows] == [(0.5, 1, 0), (0.5, 2, 1), (2.0, 1, 0), (2.0, 2, 1)]
    for r in rows:
        assert r["rate"] == pytest.approx(r["load"] * capacity["capacity_request_rate"])
    assert rows[0]["ttft_ms_p99"] < rows[2]["ttft_ms_p99"]  # seed 0 below capacity and at twice it
    plot_rows = sim_sweep.medians(rows)
    assert [(r["rate"], r["policy"]) for r in plot_rows] == [(rows[0]["rate"], "fcfs"), (rows[2]["rate"], "fcfs")]


@pytest.mark.parametrize(
    "sweep, message",
    [
        (dict(loads=(), rates=()), "set one of"),
        (dict(loads=(0.5,), rates=(10.0,)), "set one of"),
        (dict(loads=(), rates=("x",)), r"sweep\.rates must be numbers"),
        (dict(loads=(-1.0,), rates=()), r"sweep\.loads must be numbers > 0"),
    ],
)
def test_bad_sweep_points_are_refused(sweep, message):
    cfg = parse_config([], "configs/sim_sweep.py")
    cfg.sweep = sweep
    with pytest.raises(ValueError, match=message):
        sim_sweep.points_of(cfg)


def test_bench_sim_speed_times_each_policy_per_repeat_and_the_capacity_run_once():
    cfg = parse_config(["--config.policies=fcfs,static", "--config.workload.num_requests=60"], "configs/sim_zoo.py")
    with cfg.unlocked():
        cfg.policy_options = {}
    cfg, requests = cp.prepare_run(cfg)
    runs, capacity = bench_sim_speed.bench(cfg, requests, ["fcfs", "static"], repeats=2)
    assert [(r["policy"], r["run"]) for r in runs] == [
        ("fcfs", 1), ("static", 1), ("total", 1), ("static", 2), ("fcfs", 2), ("total", 2)]  # fmt: skip
    assert all(r["wall_s"] > 0 and r["cpu_s"] >= 0 and "load_average_before" in r for r in runs)
    assert all(r["generated_tokens"] > 0 for r in runs if r["policy"] != "total")
    assert capacity["load"] == cfg.workload.load and capacity["wall_s"] > 0


def test_bench_sim_speed_in_two_worker_processes_generates_what_one_process_does():
    cfg = parse_config(["--config.policies=fcfs,static", "--config.workload.num_requests=60"], "configs/sim_zoo.py")
    with cfg.unlocked():
        cfg.policy_options = {}
    cfg, requests = cp.prepare_run(cfg)
    one, _ = bench_sim_speed.bench(cfg, requests, ["fcfs", "static"], repeats=1)
    two, _ = bench_sim_speed.bench(cfg, requests, ["fcfs", "static"], repeats=1, jobs=2)
    assert [r["policy"] for r in two] == ["fcfs", "static", "total"]
    assert [r.get("generated_tokens") for r in two] == [r.get("generated_tokens") for r in one]
    assert two[-1]["jobs"] == 2 and two[-1]["cpu_s"] == sum(r["cpu_s"] for r in two[:-1])
    with pytest.raises(ValueError, match="jobs must be >= 1"):
        bench_sim_speed.bench(cfg, requests, ["fcfs"], repeats=1, jobs=0)


def test_bench_sim_speed_merges_single_repeat_files_into_one_sitting(tmp_path):
    from cbjax.bench.doc_data import write_doc_data

    paths = []
    for k, wall in enumerate([2.0, 3.0]):
        path = str(tmp_path / f"part{k}.json")
        runs = [dict(policy="fcfs", run=1, wall_s=wall), dict(policy="total", run=1, wall_s=wall)]
        write_doc_data(path, command="one repeat", runs=runs, num_requests=60, capacity_run=dict(wall_s=k))
        paths.append(path)
    out = str(tmp_path / "merged.json")
    bench_sim_speed.merge(paths, out, "the sitting")
    import json

    with open(out, encoding="utf-8") as f:
        merged = json.load(f)
    assert merged["command"] == "the sitting" and merged["num_requests"] == 60
    assert [(r["policy"], r["run"], r["wall_s"]) for r in merged["runs"]] == [
        ("fcfs", 1, 2.0), ("total", 1, 2.0), ("fcfs", 2, 3.0), ("total", 2, 3.0)]  # fmt: skip
    assert [c["wall_s"] for c in merged["capacity_runs"]] == [0, 1]
    assert [m["file"] for m in merged["merged_from"]] == paths
