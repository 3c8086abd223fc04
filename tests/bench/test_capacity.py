"""Load relative to capacity (cbjax/bench/capacity.py): the arithmetic, the checks, and in the harness the rate set
from a capacity measured before the runs."""

import datetime
import json
import math
import os

import pytest

from cbjax.bench.capacity import capacity_of, check_load, offline
from cbjax.bench.requests import WorkloadRequest
from cbjax.bench.workload import make_workload
from experiments import compare_policies as cp
from tests.bench.test_compare_policies import TINY
from tests.helpers import parse_config as parse


def test_capacity_is_the_median_run_and_a_load_scales_it():
    runs = [dict(request_throughput=r, output_throughput=10 * r) for r in (40.0, 50.0, 45.0)]
    cap = capacity_of("fcfs", runs, num_requests=600)
    assert cap.request_rate == 45.0 and cap.output_throughput == 450.0 and cap.runs == (40.0, 50.0, 45.0)
    assert cap.rate_at(0.8) == pytest.approx(36.0)
    header = cap.header(0.8)
    assert "load 0.8" in header and "fcfs" in header and "45.0 req/s" in header and "36.00 req/s" in header
    assert "40.0-50.0" in header  # the runs' spread
    d = cap.to_dict(0.8)
    assert d["request_rate"] == pytest.approx(36.0) and d["capacity_runs"] == [40.0, 50.0, 45.0]


def test_a_capacity_needs_completed_requests():
    with pytest.raises(ValueError, match="no offline run"):
        capacity_of("fcfs", [], 10)
    with pytest.raises(ValueError, match="completed no requests"):
        capacity_of("fcfs", [dict(request_throughput=0.0, output_throughput=0.0)], 10)
    with pytest.raises(ValueError, match="completed no requests"):
        capacity_of("fcfs", [dict(request_throughput=math.nan, output_throughput=0.0)], 10)


def test_offline_moves_every_arrival_to_zero_and_keeps_deadlines_relative():
    reqs = [WorkloadRequest("a", 1.5, (5, 6), 4, deadline=2.0), WorkloadRequest("b", 3.0, (7,), 2)]
    out = offline(reqs)
    assert [r.arrival_time for r in out] == [0.0, 0.0]
    assert out[0].deadline == pytest.approx(0.5) and out[1].deadline is None
    assert [r.prompt_token_ids for r in out] == [r.prompt_token_ids for r in reqs]


@pytest.mark.parametrize("load", [None, 0, 0.0])
def test_no_load_means_an_absolute_rate(load):
    assert check_load(load, "offline") is None


@pytest.mark.parametrize("load", [-0.5, math.inf, math.nan, True, "0.8"])
def test_a_bad_load_is_an_error(load):
    with pytest.raises(ValueError, match=r"workload\.load"):
        check_load(load, "poisson")


def test_a_load_needs_a_rated_arrival_process():
    assert check_load(1.2, "gamma") == 1.2
    with pytest.raises(ValueError, match="arrival"):
        check_load(0.8, "offline")
    with pytest.raises(ValueError, match="arrival"):
        cp.resolve_config(
            parse([f"--config={TINY}", "--config.workload.load=0.8", "--config.workload.arrival=offline"])
        )


def test_a_load_replays_a_trace_at_that_share_of_the_capacity():
    # A production trace's own bursts, compressed to load x capacity (workload.trace_rate), on a virtual clock.
    trace = os.path.join(os.path.dirname(__file__), "data", "burstgpt_sample.csv")
    argv = [f"--config={TINY}", "--config.workload.kind=burstgpt", f"--config.workload.path={trace}",
            "--config.workload.num_requests=5", "--config.workload.arrival=trace", "--config.workload.load=0.5",
            "--config.policies=fcfs"]  # fmt: skip
    cfg, requests = cp.prepare_run(parse(argv))
    assert all(r.arrival_time == 0.0 for r in requests)
    comp = cp.run_comparison(cfg, workload=requests, progress=False)
    times = sorted(r.arrival_time for r in comp.results["fcfs"].requests)
    own = [0.0, 113.0, 129.0, 135.0, 136.5]  # the trace's clock (tests/bench/test_production_traces.py)
    rate = 0.5 * comp.capacity.request_rate
    assert times == pytest.approx([t * (4 / 136.5) / rate for t in own])


def test_an_unknown_reference_policy_fails_before_any_run():
    with pytest.raises(ValueError, match="nope"):
        cp.resolve_config(parse([f"--config={TINY}", "--config.workload.load=0.8", "--config.capacity.policy=nope"]))


@pytest.mark.parametrize("runner", ["model", "sim"])
def test_the_harness_sets_the_rate_from_the_capacity_it_measured(runner, tmp_path):
    # test-tiny on a virtual clock (10 ms a step, or the simulator's H200 roofline): every run is deterministic,
    # so the two capacity runs agree and the rate is exactly load x their median.
    argv = [f"--config={TINY}", "--config.workload.load=0.5", "--config.capacity.runs=2", "--config.policies=fcfs"]
    if runner == "sim":
        argv += ["--config.engine.runner=sim", "--config.sim.accelerator=h200", "--config.step_cost_ms=0"]
    cfg, requests = cp.prepare_run(parse(argv))
    assert all(r.arrival_time == 0.0 for r in requests)  # the rate waits on the capacity
    comp = cp.run_comparison(cfg, workload=requests, progress=False)
    cap = comp.capacity
    assert cap.policy == "fcfs" and len(cap.runs) == 2 and cap.runs[0] == cap.runs[1] > 0
    rate = 0.5 * cap.request_rate
    expected = make_workload({**cp.workload_config(cfg).to_dict(), "request_rate": rate})
    ran = comp.results["fcfs"].requests
    assert sorted(r.arrival_time for r in ran) == pytest.approx(sorted(r.arrival_time for r in expected))
    assert comp.load_line() == cap.header(0.5)
    summaries = cp.summaries_of(cfg, comp)
    cp.write_results(comp, summaries, str(tmp_path), datetime.datetime.now())
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["load"]["load"] == 0.5 and manifest["load"]["request_rate"] == pytest.approx(rate)
    assert manifest["load"]["capacity_request_rate"] == cap.request_rate
    # --config.doc_data: the same run as a data file the docs' tables are made from, every run raw
    from cbjax.bench.doc_data import read_doc_data
    from experiments.doc_views import VIEWS

    cp.write_doc_data_of(cfg, comp, str(tmp_path / "doc.json"), ["prog", "--config.workload.load=0.5"], [0.0] * 3)
    data = read_doc_data(str(tmp_path / "doc.json"))
    assert data["command"] == "python -m experiments.compare_policies --config.workload.load=0.5"
    assert data["load"]["request_rate"] == pytest.approx(rate) and data["config"]["workload"]["load"] == 0.5
    (run,) = data["runs"]
    assert run["policy"] == "fcfs" and run["run"] == 1 and run["seed"] == cfg.workload.seed
    assert run["output_throughput"] == pytest.approx(summaries["fcfs"]["output_throughput"])
    assert "| fcfs |" in VIEWS["medians"](data, by=["policy"], columns=["output_throughput"])


def test_a_horizon_can_follow_the_last_arrival():
    # A load sets the arrival span, so the zoo ends its runs relative to the last arrival.
    wl = [WorkloadRequest("a", 0.0, (5,), 1), WorkloadRequest("b", 7.5, (6,), 1)]
    cfg = parse([f"--config={TINY}"])
    assert cp.horizon_of(cfg, wl) is None
    cfg = parse([f"--config={TINY}", "--config.horizon_after_last_arrival_s=2"])
    assert cp.horizon_of(cfg, wl) == 9.5
    cfg = parse([f"--config={TINY}", "--config.horizon_after_last_arrival_s=2", "--config.horizon_s=9"])
    assert cp.horizon_of(cfg, wl) == 9.0  # the earlier of the two
    with pytest.raises(ValueError, match="horizon_after_last_arrival_s"):
        cp.resolve_config(parse([f"--config={TINY}", "--config.horizon_after_last_arrival_s=-1"]))
