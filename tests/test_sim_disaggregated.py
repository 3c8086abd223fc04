"""Disaggregated serving on the simulator (cbjax/sim/disaggregated.py): the link's cost, tokens as colocated, every
request finished once and every page returned on both sides; the replicas' interleaving (cbjax/sim/engine_set.py)."""

import pytest

from cbjax import LLMEngine, SamplingParams
from cbjax.bench.online import run_online
from cbjax.bench.requests import WorkloadRequest
from cbjax.bench.workload import make_workload
from cbjax.core.clock import VirtualClock
from cbjax.core.scheduler_output import SchedulerOutput
from cbjax.sim import FixedCost
from cbjax.sim.disaggregated import DisaggregatedSim
from cbjax.sim.engine_set import ReplicatedSim
from cbjax.sim.links import LINKS, Link, LinkQueue

OPTS = dict(runner="sim", max_num_seqs=16, max_num_batched_tokens=256, num_pages=256, max_model_len=1024)
DECODE = dict(preemption_mode="swap", num_host_pages=256)


def engine(cost: float = 0.01, **opts):
    return LLMEngine("llama-tiny", clock=VirtualClock(), cost_model=FixedCost(cost), **{**OPTS, **opts})


def workload(n: int = 60, rate: float = 30.0, seed: int = 0):
    return make_workload(
        dict(kind="mixed", num_requests=n, seed=seed, arrival="poisson", request_rate=rate, scale=0.125,
             vocab_size=32000, max_model_len=1024)
    )  # fmt: skip


def check_pools_empty(*engines):
    for e in engines:
        sched = e.scheduler
        sched.pool.check_consistent()
        assert sched.pool.num_used == 0 and not sched.has_unfinished()
        if sched.host_pool is not None:
            assert sched.host_pool.num_free == sched.host_pool.num_pages
        assert not e.runner.prepaid_host_pages


def test_one_transfer_costs_bytes_over_bandwidth_plus_latency():
    link = Link("test", 2e9, 3e-3, "a test")
    p, d = engine(0.02), engine(0.02, **DECODE)
    sim = DisaggregatedSim([p], [d], link=link)
    (rec,) = run_online(sim, [WorkloadRequest("a", 0.0, tuple(range(3, 103)), 5)]).requests
    (t,) = sim.transfers
    page_size = p.config.cache.page_size
    assert t.num_pages == -(-100 // page_size)
    assert t.nbytes == t.num_pages * p.runner.kv_bytes_per_page
    assert t.start == t.ready  # the link was idle
    assert t.arrival - t.ready == pytest.approx(t.nbytes / 2e9 + 3e-3, rel=1e-12)
    assert link.transfer_time(t.nbytes) == pytest.approx(t.nbytes / 2e9 + 3e-3, rel=1e-12)
    assert t.ready == pytest.approx(0.02)  # the prompt's one step
    assert rec.first_token_time == pytest.approx(t.arrival) and rec.output_len == 5
    check_pools_empty(p, d)


def test_the_link_sends_one_transfer_at_a_time():
    q = LinkQueue(Link("test", 1e9, 1e-3, "a test"))
    assert q.send(0.0, 10**6) == pytest.approx((0.0, 2e-3))
    assert q.send(0.0005, 10**6) == pytest.approx((1e-3, 3e-3))  # waits for the first to leave the wire
    assert q.send(5.0, 0) == pytest.approx((5.0, 5.001))


def test_ttft_includes_the_transfer():
    link = Link("slow", 1e8, 0.05, "a slow test link")
    p, d = engine(0.02), engine(0.02, **DECODE)
    sim = DisaggregatedSim([p], [d], link=link)
    res = run_online(sim, workload(20, 5.0))
    by_id = {t.request_id: t for t in sim.transfers}
    for r in res.requests:
        t = by_id[r.request_id]
        assert r.first_token_time == pytest.approx(t.arrival)  # run_online's records start at time 0
        assert r.first_token_time - t.ready >= 0.05 + t.nbytes / 1e8 - 1e-9
        assert r.token_times[1] > r.first_token_time


@pytest.mark.parametrize("policy", ["fcfs", "sarathi"])
def test_a_free_link_gives_the_colocated_tokens(policy):
    wl = workload()
    colocated = run_online(engine(policy=policy), wl)
    sim = DisaggregatedSim([engine(policy=policy)], [engine(policy=policy, **DECODE)], link=LINKS["free"])
    disagg = run_online(sim, wl)
    assert len(disagg.output_token_ids) == len(wl)
    assert disagg.output_token_ids == colocated.output_token_ids  # the same token ids, so the same counts
    assert {r.request_id: r.output_len for r in disagg.requests} == {r.request_id: r.max_tokens for r in wl}
    assert all(t.arrival == t.ready for t in sim.transfers)


@pytest.mark.parametrize("num_prefill,num_decode", [(1, 1), (2, 1), (1, 2)])
def test_every_request_finishes_once_and_every_page_comes_back(num_prefill, num_decode):
    # Small decode pools: decode engines preempt (by swap) and their host pools push back on the transfers.
    prefill = [engine() for _ in range(num_prefill)]
    decode = [engine(num_pages=64, preemption_mode="swap", num_host_pages=48) for _ in range(num_decode)]
    sim = DisaggregatedSim(prefill, decode, link=Link("test", 1e9, 1e-3, "a test"))
    wl = workload(80, 60.0, seed=1)
    res = run_online(sim, wl)
    ids = [r.request_id for r in res.requests]
    assert sorted(ids) == sorted(r.request_id for r in wl) and len(set(ids)) == len(ids)
    assert all(r.finish_reason == "length" for r in res.requests)
    assert sum(e.scheduler.num_preemptions for e in decode) > 0  # the small pools did preempt
    assert len(sim.transfers) == sum(r.max_tokens > 1 for r in wl)
    check_pools_empty(*prefill, *decode)


def test_aborts_at_the_horizon_leak_nothing():
    prefill, decode = [engine()], [engine(num_pages=64, **DECODE)]
    sim = DisaggregatedSim(prefill, decode, link=Link("test", 1e8, 1e-2, "a test"))
    res = run_online(sim, workload(60, 60.0), horizon_s=0.5)
    assert any(r.aborted for r in res.requests)
    assert not sim.has_unfinished_requests()
    check_pools_empty(*prefill, *decode)


def test_one_replica_runs_as_the_engine_alone():
    wl = workload()
    alone = run_online(engine(policy="sarathi"), wl)
    replicated = run_online(ReplicatedSim([engine(policy="sarathi")]), wl)
    assert replicated.requests == alone.requests


def test_two_replicas_share_the_work():
    engines = [engine(), engine()]
    res = run_online(ReplicatedSim(engines), workload(60, 60.0))
    assert all(r.finish_reason == "length" for r in res.requests)
    assert all(e.num_steps > 0 for e in engines)
    check_pools_empty(*engines)


def test_bad_setups_are_refused():
    with pytest.raises(ValueError, match="host pool"):
        DisaggregatedSim([engine()], [engine()])
    shared = VirtualClock()
    a = LLMEngine("llama-tiny", clock=shared, cost_model=FixedCost(0.01), **OPTS)
    b = LLMEngine("llama-tiny", clock=shared, cost_model=FixedCost(0.01), **OPTS, **DECODE)
    with pytest.raises(ValueError, match="own VirtualClock"):
        DisaggregatedSim([a], [b])
    with pytest.raises(ValueError, match="unknown link"):
        DisaggregatedSim([engine()], [engine(**DECODE)], link="carrier-pigeon")
    sim = DisaggregatedSim([engine()], [engine(**DECODE)])
    with pytest.raises(ValueError, match="plain sampling"):
        sim.add_request("a", [5, 6, 7], SamplingParams(max_tokens=4, n=2))
    sim.add_request("b", [5, 6, 7], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="duplicate"):
        sim.add_request("b", [5, 6, 7], SamplingParams(max_tokens=4))


def test_a_landed_transfer_is_not_priced_again_as_a_swap_in():
    runner = engine(**DECODE).runner
    out = SchedulerOutput([], 0, [], 0.0)
    out.swap_in = [(5, 1), (6, 2)]
    runner.prepaid_host_pages.update({5, 9})
    assert runner.dispatch(out).features.swap_bytes == runner.kv_bytes_per_page  # page 6 only
    assert runner.prepaid_host_pages == {9}
    out.swap_in = [(5, 1)]
    assert runner.dispatch(out).features.swap_bytes == runner.kv_bytes_per_page  # paid once
    out.swap_in, out.swap_out = [], [(3, 9)]  # host page 9 reused by a preemption: an ordinary page again
    runner.dispatch(out)
    assert not runner.prepaid_host_pages
