"""The engine on the simulator: no weights, deterministic runs, the options checked, a 10k-request smoke run."""

import time

import pytest

from cbjax import LLMEngine, SamplingParams
from cbjax.bench.online import run_online
from cbjax.bench.workload import make_workload
from cbjax.core.clock import RealClock
from cbjax.engine_config import EngineConfig
from cbjax.sim import FixedCost, RooflineCost

OPTS = dict(runner="sim", max_num_seqs=32, max_num_batched_tokens=256, num_pages=512, max_model_len=1024)


def mixed(n: int, rate: float, seed: int = 0):
    return make_workload(
        dict(kind="mixed", num_requests=n, seed=seed, arrival="poisson", request_rate=rate, scale=0.125,
             vocab_size=32000, max_model_len=1024)
    )  # fmt: skip


def run(policy: str, workload, **opts):
    engine = LLMEngine("llama-tiny", cost_model=FixedCost(0.02), **{**OPTS, "policy": policy, **opts})
    return engine, run_online(engine, workload)


@pytest.mark.parametrize("policy", ["fcfs", "mlfq"])
def test_a_sim_run_is_deterministic(policy):
    wl = mixed(200, 40.0)
    _, a = run(policy, wl)
    _, b = run(policy, wl)
    assert a.requests == b.requests
    assert [s.time for s in a.steps] == [s.time for s in b.steps]
    assert all(r.finish_reason == "length" for r in a.requests)
    assert {r.request_id: r.output_len for r in a.requests} == {r.request_id: r.max_tokens for r in wl}


def test_the_step_cost_sets_the_clock():
    """With a fixed cost and one request, every token is one step later than the one before."""
    engine = LLMEngine("llama-tiny", cost_model=FixedCost(0.25), **{**OPTS, "async_scheduling": False})
    engine.add_request("a", [5] * 20, SamplingParams(max_tokens=4, ignore_eos=True))
    list(engine.stream())
    assert engine.model is None and engine.num_compiles == 0 and engine.warmup_s == 0.0
    assert engine.clock.now() == pytest.approx(4 * 0.25)


def test_eos_where_the_workload_says():
    engine = LLMEngine("llama-tiny", cost_model=FixedCost(0.01), **OPTS)
    engine.runner.stop_after["b"] = 3
    for rid in ("a", "b"):
        engine.add_request(rid, [7] * 10, SamplingParams(max_tokens=8))
    done = {o.request_id: o.outputs[0] for o in engine.stream() if o.finished}
    assert len(done["a"].token_ids) == 8 and done["a"].finish_reason == "length"
    assert len(done["b"].token_ids) == 3 and done["b"].finish_reason == "stop"


def test_blocks_of_decode_steps_on_the_simulator():
    """num_scheduler_steps: the same tokens (the simulator's are a function of the index), fewer dispatches, a block
    of N steps costing N steps; a request's EOS inside a block ends it there."""
    done = {}
    for steps in (1, 4):
        engine = LLMEngine("llama-tiny", cost_model=FixedCost(0.01), **{**OPTS, "num_scheduler_steps": steps})
        engine.runner.stop_after["b"] = 6
        for rid in ("a", "b", "c"):
            engine.add_request(rid, [7] * 10, SamplingParams(max_tokens=21))
        done[steps] = {o.request_id: o.outputs[0].token_ids for o in engine.stream() if o.finished}
        records = engine.step_records
        if steps == 4:
            assert any(r["decode_steps"] == 4 for r in records)
            assert len(records) < 21
        # Every output token costs one step of the clock whether or not it came in a block (async: the first step
        # is scheduled at 0 and the steps run back to back).
        assert engine.clock.now() == pytest.approx(0.01 * sum(r["decode_steps"] for r in records))
    assert done[1] == done[4] and len(done[4]["b"]) == 6 and len(done[4]["a"]) == 21


def test_the_step_time_scale_stretches_time_and_changes_no_decision():
    """Offline fcfs decides nothing by the clock, so twice the step time gives the same batches at twice the
    times; with a roofline, the KV pool is the accelerator's still."""
    wl = make_workload(dict(kind="mixed", num_requests=40, seed=1, arrival="offline", scale=0.125,
                            vocab_size=32000, max_model_len=1024))  # fmt: skip
    (_, one), (_, two) = run("fcfs", wl), run("fcfs", wl, sim_step_time_scale=2.0)

    def batches(res):
        return [(s.num_scheduled_seqs, s.num_scheduled_tokens, s.padded_tokens, s.kv_pages_used) for s in res.steps]

    assert batches(one) == batches(two) and len(one.steps) > 10
    assert [2 * s.time for s in one.steps] == pytest.approx([s.time for s in two.steps])
    assert [2 * r.finished_time for r in one.requests] == pytest.approx([r.finished_time for r in two.requests])
    big = LLMEngine("llama-7b", runner="sim", sim_accelerator="h200", max_model_len=4096, sim_step_time_scale=3.0)
    assert big.config.cache.num_pages == RooflineCost.for_model(big.model_config, "h200").kv_pages(16)
    with pytest.raises(ValueError, match="sim_step_time_scale must be"):
        EngineConfig.from_options(runner="sim", sim_step_time_scale=0.0)


def test_the_roofline_sizes_the_kv_pool_from_the_accelerators_memory():
    engine = LLMEngine("llama-7b", runner="sim", sim_accelerator="h200", max_model_len=4096)
    expected = RooflineCost.for_model(engine.model_config, "h200").kv_pages(16)
    assert engine.config.cache.num_pages == expected > 10_000  # ~100 GB of KV after 13.5 GB of weights


def test_the_options_are_checked():
    with pytest.raises(ValueError, match="runner must be one of"):
        EngineConfig.from_options(runner="gpu")
    with pytest.raises(ValueError, match="sim_accelerator must be one of"):
        EngineConfig.from_options(runner="sim", sim_accelerator="a100")
    with pytest.raises(ValueError, match="both set"):
        EngineConfig.from_options(runner="sim", sim_accelerator="h200", sim_profile="p.json")
    with pytest.raises(ValueError, match="needs sim_profile"):
        LLMEngine("llama-tiny", runner="sim")
    with pytest.raises(ValueError, match="VirtualClock"):
        LLMEngine("llama-tiny", clock=RealClock(), cost_model=FixedCost(0.1), **OPTS)
    with pytest.raises(ValueError, match="cost_model is for runner='sim'"):
        LLMEngine("test-tiny", cost_model=FixedCost(0.1))
    engine = LLMEngine("llama-tiny", cost_model=FixedCost(0.1), **OPTS)
    with pytest.raises(ValueError, match="step_cost_s is for the real runner"):
        run_online(engine, mixed(2, 1.0), step_cost_s=0.1)


@pytest.mark.parametrize("policy", ["fcfs", "static"])
def test_ten_thousand_requests_smoke(policy):
    """10k requests of the mix through the simulator in a generous bound (the speed itself: docs/sim.md). Under
    static the queue grows to thousands; while every step walked and sorted all of it, static alone took 41 s of
    the zoo run at 26/s (this runs at 40/s)."""
    wl = mixed(10_000, 40.0, seed=1)
    t0 = time.perf_counter()
    _, res = run(policy, wl)
    assert time.perf_counter() - t0 < 60.0
    assert sum(r.finish_reason == "length" for r in res.requests) == 10_000
