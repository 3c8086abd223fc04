"""The online loop on test-tiny: arrivals respected, idle jumps, static batches, client time windows, Ctrl-C.

Most tests run on a VirtualClock with a fixed 10 ms step cost, so every timestamp is known exactly: a request
is scheduled at the first step boundary at or after its arrival, and its tokens are stamped at the end of the
step that produced them. Engine shapes match configs/compare_tiny.py, so the whole pytest process compiles once.
"""

import itertools
import time

import pytest

from cbjax import LLMEngine
from cbjax.bench.metrics import StepRecord
from cbjax.bench.online import ClientBatching, plan_policy, run_online
from cbjax.bench.requests import WorkloadRequest
from cbjax.core import RealClock, VirtualClock

COST = 0.01  # virtual seconds per step
SHAPES = dict(max_num_seqs=4, max_num_batched_tokens=16, num_pages=64, max_model_len=128)


def engine(policy="fcfs", timeout=0.0, clock=None, async_scheduling=False):
    # One step at a time by default: the exact timestamps below assume a step is scheduled after the previous one's
    # results arrive. (Asynchronously, step n+1 is scheduled while step n runs, so an arrival during step n joins
    # at step n+2: test_async_scheduling_serves_the_same_tokens_one_step_later.)
    return LLMEngine(
        "test-tiny",
        clock=clock or VirtualClock(),
        policy=policy,
        static_batch_timeout_s=timeout,
        async_scheduling=async_scheduling,
        **SHAPES,
    )


def workload(arrivals, prompt_len=4, max_tokens=3, long_ids=()):
    return [
        WorkloadRequest(
            f"r{i}",
            float(t),
            tuple(range(10 + i, 10 + i + prompt_len)),
            max_tokens,
            length_class="long" if i in long_ids else "short",
        )
        for i, t in enumerate(arrivals)
    ]


def by_id(result):
    return {r.request_id: r for r in result.requests}


def test_plan_policy_table():
    assert plan_policy("fcfs").engine_options["policy"] == "fcfs" and plan_policy("fcfs").client is None
    static = plan_policy("static", static_batch_timeout_s=0.3)
    assert static.engine_options == {"policy": "static", "static_batch_timeout_s": 0.3} and static.client is None
    tw = plan_policy("time_window", static_batch_timeout_s=0.3, window_ms=50, max_batch=8)
    # The client batches; the engine must start whatever it is handed, so its own timeout is off.
    assert tw.engine_options == {"policy": "static", "static_batch_timeout_s": 0.0}
    assert tw.client == ClientBatching(0.05, 8)
    sjf = plan_policy("sjf", policy_options={"victim": "longest_running"})
    assert (
        sjf.engine_options["policy"] == "sjf"
        and sjf.engine_options["policy_options"] == {"victim": "longest_running"}
        and sjf.client is None
    )
    with pytest.raises(ValueError, match="unknown policy"):
        plan_policy("nope")


def test_fcfs_joins_a_running_batch_and_static_does_not():
    wl = workload([0.0, 0.025], prompt_len=8, max_tokens=10)
    fcfs = by_id(run_online(engine("fcfs"), wl, step_cost_s=COST))
    # r0 prefills in the step [0, 0.01) and gets its first token at the step's end; 10 tokens -> done at 0.10.
    assert fcfs["r0"].first_scheduled_time == 0.0
    assert fcfs["r0"].first_token_time == pytest.approx(0.01)
    assert fcfs["r0"].finished_time == pytest.approx(0.10)
    # r1 arrives during the step [0.02, 0.03) and joins at the next boundary while r0 still runs.
    assert fcfs["r1"].first_scheduled_time == pytest.approx(0.03)
    static = by_id(run_online(engine("static"), wl, step_cost_s=COST))
    assert static["r1"].first_scheduled_time == pytest.approx(0.10)  # waits for r0's batch to finish
    for recs in (fcfs, static):
        assert all(r.finish_reason == "length" and r.output_len == 10 for r in recs.values())


def test_no_request_is_scheduled_before_it_arrives():
    arrivals = [0.0, 0.003, 0.011, 0.04, 0.041, 0.07, 0.2, 0.2005]
    for policy in ("fcfs", "static"):
        res = run_online(engine(policy, timeout=0.02), workload(arrivals, max_tokens=4), step_cost_s=COST)
        assert len(res.requests) == len(arrivals)
        for r in res.requests:
            assert r.first_scheduled_time >= r.arrival_time, (policy, r)
            assert r.token_times == sorted(r.token_times) and r.token_times[0] > r.first_scheduled_time


def test_idle_engine_jumps_to_the_next_arrival():
    res = run_online(engine("fcfs"), workload([0.0, 5.0]), step_cost_s=COST)
    recs = by_id(res)
    assert recs["r1"].first_scheduled_time == pytest.approx(5.0)
    assert recs["r1"].first_token_time == pytest.approx(5.01)
    assert len(res.steps) == 6  # 3 tokens each; no step while idle
    assert res.wall_s < 3.0  # virtual time: the 5 s gap was jumped, not slept
    assert all(isinstance(s, StepRecord) for s in res.steps)
    assert [s.time for s in res.steps] == pytest.approx([0.01, 0.02, 0.03, 5.01, 5.02, 5.03])


def test_static_waits_for_a_full_batch_or_the_timeout():
    # Four arrivals fill the batch (max_num_seqs=4) at 0.15, before the 0.3 s timeout; the lone fifth waits it out.
    res = run_online(engine("static", timeout=0.3), workload([0.0, 0.05, 0.1, 0.15, 1.0]), step_cost_s=COST)
    recs = by_id(res)
    assert [recs[f"r{i}"].first_scheduled_time for i in range(4)] == pytest.approx([0.15] * 4)
    assert recs["r4"].first_scheduled_time == pytest.approx(1.3, abs=1e-5)
    assert recs["r0"].first_token_time - recs["r0"].arrival_time == pytest.approx(0.16)  # TTFT includes the wait


def test_time_window_groups_arrivals_on_the_client():
    plan = plan_policy("time_window", window_ms=100, max_batch=3)
    eng = engine(**{"policy": plan.engine_options["policy"], "timeout": plan.engine_options["static_batch_timeout_s"]})
    arrivals = [0.0, 0.02, 0.04, 0.05, 0.5, 0.52]
    res = run_online(eng, workload(arrivals), client=plan.client, step_cost_s=COST)
    recs = by_id(res)
    # r0-r2: max_batch reached at 0.04. r3: alone until its window closes at 0.15. r4, r5: the window 0.5-0.6.
    got = [recs[f"r{i}"].first_scheduled_time for i in range(6)]
    assert got == pytest.approx([0.04, 0.04, 0.04, 0.15, 0.6, 0.6])
    assert recs["r4"].first_token_time - recs["r4"].arrival_time == pytest.approx(0.11)  # client wait counted


def test_measured_step_cost_moves_the_virtual_clock():
    res = run_online(engine("fcfs"), workload([0.0, 0.0, 0.001]), step_cost_s=None)
    times = [s.time for s in res.steps]
    assert all(b > a for a, b in itertools.pairwise(times)) and times[0] > 0
    assert all(r.finish_reason == "length" for r in res.requests)


def test_real_clock_sleeps_until_arrivals():
    t = time.perf_counter()
    res = run_online(engine("fcfs", clock=RealClock()), workload([0.0, 0.3], max_tokens=2))
    assert time.perf_counter() - t >= 0.3
    recs = by_id(res)
    assert recs["r1"].first_scheduled_time >= 0.3 and recs["r1"].finish_reason == "length"
    with pytest.raises(ValueError, match="VirtualClock"):
        run_online(engine("fcfs", clock=RealClock()), workload([0.0]), step_cost_s=COST)


def test_a_refused_request_is_recorded_as_aborted_and_the_rest_run():
    wl = workload([0.0, 0.0, 0.01], max_tokens=3)
    too_long = WorkloadRequest("big", 0.005, tuple(range(3, 103)), 100)  # 200 tokens > max_model_len 128
    res = run_online(engine("fcfs"), sorted(wl + [too_long], key=lambda r: r.arrival_time), step_cost_s=COST)
    recs = by_id(res)
    assert recs["big"].finish_reason == "abort" and recs["big"].output_len == 0
    assert all(recs[f"r{i}"].finish_reason == "length" for i in range(3))


def test_ctrl_c_stops_cleanly_and_returns_what_was_measured():
    eng = engine("fcfs")

    def interrupt(progress):
        if progress.num_steps == 4:
            raise KeyboardInterrupt

    wl = workload([0.0, 0.0, 0.015, 0.025, 1.0, 2.0], max_tokens=3)
    res = run_online(eng, wl, step_cost_s=COST, on_step=interrupt)
    assert res.interrupted and res.num_not_arrived == 2  # the 1.0 s and 2.0 s requests never arrived
    recs = by_id(res)
    assert set(recs) == {"r0", "r1", "r2", "r3"}
    assert recs["r0"].finish_reason == "length" and recs["r0"].output_len == 3  # finished in steps 1-3
    assert recs["r3"].finish_reason == "abort"
    assert len(res.steps) == 4
    # The engine is left clean: nothing unfinished, every page back, its clock hook removed.
    assert not eng.has_unfinished_requests() and eng.scheduler.pool.num_used == 0
    assert eng.after_execute is None


def test_ctrl_c_aborts_requests_held_by_the_client():
    plan = plan_policy("time_window", window_ms=1000, max_batch=2)

    def interrupt(progress):
        raise KeyboardInterrupt

    res = run_online(
        engine("static"), workload([0.0, 0.0, 0.0]), client=plan.client, step_cost_s=COST, on_step=interrupt
    )
    recs = by_id(res)
    assert res.interrupted and recs["r2"].finish_reason == "abort" and recs["r2"].first_scheduled_time is None
    assert recs["r0"].finish_reason == "abort" and recs["r0"].first_scheduled_time == 0.0


def test_horizon_ends_the_run_and_counts_the_rest_as_not_completed():
    # 8 requests of 30 tokens through 4 slots at 10 ms a step: about 0.6 s of work, cut at 0.2 s.
    wl = workload([0.0] * 6 + [0.1, 0.5], max_tokens=30)
    res = run_online(engine(), wl, step_cost_s=COST, horizon_s=0.2)
    recs = by_id(res)
    assert not res.interrupted and res.num_not_arrived == 1  # r7 would arrive at 0.5 s
    assert set(recs) == {f"r{i}" for i in range(7)}
    assert all(r.finish_reason == "abort" for r in recs.values())  # none could finish 30 tokens in 0.2 s
    assert max(s.time for s in res.steps) <= 0.2 + COST
    assert res.output_token_ids == {}
    full = run_online(engine(), wl, step_cost_s=COST)
    assert all(r.finish_reason == "length" for r in full.requests) and len(full.output_token_ids) == 8


def test_async_scheduling_serves_the_same_tokens_one_step_later():
    wl = workload([0.0, 0.0, 0.015, 0.025, 0.1], max_tokens=4)
    sync = run_online(engine("fcfs"), wl, step_cost_s=COST)
    asyn = run_online(engine("fcfs", async_scheduling=True), wl, step_cost_s=COST)
    assert asyn.output_token_ids == sync.output_token_ids and len(asyn.output_token_ids) == len(wl)
    s, a = by_id(sync), by_id(asyn)
    # Tokens are still stamped at the end of the step that made them; a request that arrives while a step runs
    # misses the step scheduled meanwhile, so its first token comes at most one step later.
    for rid in s:
        assert s[rid].first_token_time <= a[rid].first_token_time <= s[rid].first_token_time + COST + 1e-9
    assert a["r0"].first_token_time == pytest.approx(COST)  # the first step still ends at COST
