"""Disaggregated prefill/decode serving (cbjax/disaggregated.py): greedy tokens equal the colocated engine's and the
full forward's, seeded sampling continues its stream on the decode engine, preemption on the decode side (recompute
and swap), aborts in every phase, bad input refused, and no page leaked or held on either side.

In this process jax has one CPU device, so every engine wraps onto it (the KV still goes through the gather, the
copy and the scatter); the last test runs engines on distinct fake devices in a fresh process."""

import pytest

from cbjax import LLM, SamplingParams
from cbjax.bench.metrics import StepRecord
from cbjax.disaggregated import DisaggregatedEngine
from cbjax.model import get_model_config, init_model
from tests.helpers import drain, greedy_reference, random_workload, run_on_fake_devices

OPTS = dict(max_num_seqs=4, max_num_batched_tokens=32, page_size=8, num_pages=40, max_model_len=96)
GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return init_model(get_model_config("test-tiny"), seed=0)


@pytest.fixture(scope="module")
def workload():
    # Prompts up to 60 tokens: chunked over steps of 32; outputs long enough to meet preemption on small pools.
    return random_workload(10, seed=3, vocab=512, prompt_range=(1, 60), max_tokens_range=(1, 30))


@pytest.fixture(scope="module")
def reference(model, workload):
    prompts, params = workload
    colocated = [o.outputs[0].token_ids for o in LLM(model, **OPTS).generate(prompts, params)]
    assert colocated == greedy_reference(model, prompts, [p.max_tokens for p in params], 96)
    return colocated


def assert_nothing_left(engine: DisaggregatedEngine) -> None:
    assert not engine.has_unfinished_requests()
    for e in engine.engines:
        e.scheduler.pool.check_consistent()
        assert e.scheduler.pool.num_free == e.scheduler.pool.num_pages
        if e.scheduler.host_pool is not None:
            assert e.scheduler.host_pool.num_free == e.scheduler.host_pool.num_pages
    for e in engine.prefill:
        assert not e.scheduler.kv_handoff.held and not e.scheduler.kv_handoff.marked


@pytest.mark.parametrize("num_prefill, num_decode", [(1, 1), (1, 2), (2, 1)])
def test_greedy_tokens_equal_the_colocated_engine(model, workload, reference, num_prefill, num_decode):
    prompts, params = workload
    llm = LLM(model, disaggregation={"prefill": num_prefill, "decode": num_decode}, **OPTS)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == reference
    e = llm.engine
    moved = sum(p.max_tokens > 1 for p in params)  # max_tokens=1: prompt-only work, finished on the prefill engine
    assert len(e.transfers) == moved and sum(e.num_routed["decode"]) == moved
    assert min(e.num_routed["prefill"]) > 0 and min(e.num_routed["decode"]) > 0
    assert all(t["nbytes"] > 0 and t["num_pages"] > 0 for t in e.transfers)
    assert sum(r["kv_transfer_bytes"] for r in e.transfer_records) == e.transfer_summary()["bytes"]
    steps = [StepRecord(**r) for r in e.step_records]  # what the online harness reads
    assert {s.replica for s in steps} == set(range(num_prefill + num_decode))
    # Each transfer is charged to a decode engine's step (the first it scheduled after the transfer), none to a
    # prefill engine's.
    assert sum(s.kv_transfers for s in steps) == moved
    assert sum(s.kv_transfer_bytes for s in steps) == e.transfer_summary()["bytes"]
    assert all(s.replica >= num_prefill for s in steps if s.kv_transfers)
    assert_nothing_left(e)


@pytest.mark.parametrize("mode, caching", [("recompute", False), ("swap", False), ("recompute", True)])
def test_preemption_on_the_decode_side_keeps_the_tokens(model, workload, reference, mode, caching):
    prompts, params = workload
    decode = dict(num_pages=14, preemption_mode=mode, num_host_pages=64, policy="sjf")  # a policy of its own
    # With the prefix cache, the transferred pages join the decode engine's cache (a recompute may hit them).
    prefill = dict(policy="lpm") if caching else {}
    spec = {"prefill": 1, "decode": 1, "decode_options": decode, "prefill_options": prefill}
    llm = LLM(model, disaggregation=spec, enable_prefix_caching=caching, **OPTS)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == reference
    sched = llm.engine.decode[0].scheduler
    assert sched.num_preemptions > 0 and sched.policy.name == "sjf"
    assert (sched.num_swapped_out_pages > 0) == (mode == "swap")
    assert_nothing_left(llm.engine)


def test_seeded_sampling_continues_its_stream_on_the_decode_engine(model, workload):
    prompts, _ = workload
    params = [
        SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=None if i % 3 == 0 else 100 + i)
        for i in range(len(prompts))
    ]
    colocated = [o.outputs[0].token_ids for o in LLM(model, **OPTS).generate(prompts, params)]
    llm = LLM(model, disaggregation={"prefill": 2, "decode": 1}, **OPTS)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == colocated
    assert_nothing_left(llm.engine)


def test_the_online_harness_runs_it_like_an_engine(model, workload):
    from cbjax.bench.online import run_online
    from cbjax.bench.requests import WorkloadRequest
    from cbjax.core.clock import VirtualClock
    from cbjax.engine import LLMEngine

    prompts, params = workload
    wl = [WorkloadRequest(f"r{i}", 0.01 * i, tuple(p), sp.max_tokens) for i, (p, sp) in enumerate(zip(prompts, params))]
    colocated = run_online(LLMEngine(model, clock=VirtualClock(), **OPTS), wl, step_cost_s=0.005)
    e = DisaggregatedEngine(model, disaggregation={"prefill": 1, "decode": 1}, clock=VirtualClock(), **OPTS)
    res = run_online(e, wl, step_cost_s=0.005)
    assert res.output_token_ids == colocated.output_token_ids and len(res.output_token_ids) == len(wl)
    assert {s.replica for s in res.steps} == {0, 1}
    assert_nothing_left(e)


@pytest.fixture(scope="module")
def engine(model):
    # One decode slot: a second prefilled request waits for it between the engines.
    return DisaggregatedEngine(
        model, disaggregation={"prefill": 1, "decode": 1, "decode_options": {"max_num_seqs": 1}}, **OPTS
    )


def test_the_first_token_is_reported_once_its_kv_is_on_the_decode_engine(engine, model):
    e = engine
    e.add_request("s", list(range(3, 40)), SamplingParams(max_tokens=6, **GREEDY))
    deltas, reported_at = [], None
    while e.has_unfinished_requests():
        outs = e.step()
        for out in outs:
            assert out.request_id == "s"
            if out.outputs[0].new_token_ids and reported_at is None:
                reported_at = len(e.transfers)
            deltas += out.outputs[0].new_token_ids
    assert reported_at == 1  # not before the transfer
    (t,) = [t for t in e.transfers if t["request_id"] == "s"]
    assert out.finished and deltas == out.outputs[0].token_ids and len(deltas) == 6
    assert out.metrics.first_token_time == t["time"]  # TTFT ends when the KV arrived
    assert deltas == greedy_reference(model, [list(range(3, 40))], [6], 96)[0]
    assert_nothing_left(e)


def test_abort_in_every_phase_frees_every_page(engine):
    e = engine
    done = {}

    def step():
        done.update((o.request_id, o) for o in e.step() if o.finished)

    p = SamplingParams(max_tokens=20, **GREEDY)
    e.add_request("a", list(range(5, 60)), p)  # 55 prompt tokens: two prefill steps of 32
    step()
    assert e.phase("a") == "prefill"
    e.abort_request("a")
    e.add_request("b", [7, 8, 9], p)
    e.add_request("c", [10, 11, 12], p)
    while e.phase("b") != "decode" or e.phase("c") != "queued":  # one decode slot: c waits for it
        step()
    e.abort_request("c")  # between the engines
    assert e.phase("c") == "queued"  # until its output is reported
    with pytest.raises(ValueError, match="unknown request id"):
        e.abort_request("c")
    step()
    e.abort_request("b")  # on the decode engine
    with pytest.raises(ValueError, match="unknown request id"):
        e.abort_request("zz")
    done |= drain(e)
    assert {rid: o.outputs[0].finish_reason for rid, o in done.items()} == dict(a="abort", b="abort", c="abort")
    assert len(done["c"].outputs[0].token_ids) == 1 and len(done["b"].outputs[0].token_ids) >= 1
    assert e.phase("a") is None and e.phase("c") is None
    assert_nothing_left(e)
    for rid, prompt in (("x", [3, 4]), ("y", [5, 6])):
        e.add_request(rid, prompt, p)
    e.step()
    e.abort_all()  # in whatever phase each is
    assert {rid: o.outputs[0].finish_reason for rid, o in drain(e).items()} == dict(x="abort", y="abort")
    assert_nothing_left(e)


def test_prompt_only_work_and_a_stop_on_the_first_token_end_on_the_prefill_engine(engine, model):
    e = engine
    first = greedy_reference(model, [[4, 5, 6]], [1], 96)[0][0]
    routed = list(e.num_routed["decode"])
    e.add_request("one", [4, 5, 6], SamplingParams(max_tokens=1, **GREEDY))
    e.add_request("stop", [4, 5, 6], SamplingParams(max_tokens=9, temperature=0.0, stop_token_ids=[first]))
    done = drain(e)
    assert done["one"].outputs[0].token_ids == [first] and done["one"].outputs[0].finish_reason == "length"
    assert done["stop"].outputs[0].token_ids == [first] and done["stop"].outputs[0].finish_reason == "stop"
    assert e.num_routed["decode"] == routed
    assert_nothing_left(e)


@pytest.mark.parametrize(
    "prompt, params, message",
    [
        ([1, 2], SamplingParams(n=2), "n > 1 and best_of are not supported"),
        ([1, 2], SamplingParams(logprobs=1), "sampling extras"),
        ([1, 2], SamplingParams(max_tokens=95), "exceeds max_model_len=96"),
        ([], SamplingParams(), "empty prompt"),
        ([1, 10**6], SamplingParams(), "prompt"),
        ([1, 2], "greedy", "params must be SamplingParams"),
    ],
)
def test_bad_requests_are_refused(engine, prompt, params, message):
    with pytest.raises(ValueError, match=message):
        engine.add_request("bad", prompt, params)
    assert engine.phase("bad") is None and not engine.has_unfinished_requests()
    assert_nothing_left(engine)


def test_a_request_too_big_for_the_decode_pool_is_refused(model):
    e = DisaggregatedEngine(model, disaggregation={"decode_options": {"num_pages": 6}}, **OPTS)
    with pytest.raises(ValueError, match="a decode engine's pool has only 6"):
        e.add_request("big", list(range(3, 40)), SamplingParams(max_tokens=30))
    e.add_request("dup", [3], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="duplicate request id"):
        e.add_request("dup", [3], SamplingParams())
    drain(e)
    assert_nothing_left(e)


@pytest.mark.parametrize(
    "spec, message",
    [
        ({"prefill": 0}, "disaggregation prefill must be an integer >= 1"),
        ({"encode": 1}, "unknown keys"),
        ({"decode_options": {"page_size": 16}}, "may not set"),
        ({"decode_router": "random"}, "router must be one of"),
        ([1, 1], "disaggregation must be a dict"),
        ({"decode_options": {"enable_prefix_caching": True, "host_cache_gib": 0.01}}, "host tier"),
    ],
)
def test_bad_disaggregation_is_refused(spec, message):
    with pytest.raises(ValueError, match=message):
        LLM("test-tiny", disaggregation=spec)


SCRIPT = """
import json
from cbjax import LLM
from cbjax.model import get_model_config, init_model
from tests.helpers import random_workload

opts = {opts!r}
model = init_model(get_model_config("test-tiny"), seed=0)
prompts, params = random_workload(10, seed=4, vocab=512, prompt_range=(1, 60), max_tokens_range=(2, 20))
ref = [o.outputs[0].token_ids for o in LLM(model, **opts).generate(prompts, params)]
report = {{}}
for p, d in ((1, 2), (2, 1)):
    llm = LLM(model, disaggregation={{"prefill": p, "decode": d}}, warmup="full", **opts)
    e = llm.engine
    warm = e.num_compiles
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    report[f"{{p}},{{d}}"] = dict(
        same=got == ref,
        kv_devices=[sorted(x.id for x in g.runner.kv_caches[0][0].devices()) for g in e.engines],
        free=[g.scheduler.pool.num_free for g in e.engines],
        transfers=len(e.transfers),
        nbytes=e.transfer_summary()["bytes"],
        compiles_after_warmup=e.num_compiles - warm,
    )
print("REPORT " + json.dumps(report))
"""


def test_engines_on_distinct_fake_devices_generate_the_colocated_tokens():
    report = run_on_fake_devices(SCRIPT.format(opts=OPTS), 3)
    for shape, r in report.items():
        assert r["same"], shape
        assert r["kv_devices"] == [[0], [1], [2]], shape  # prefill engines first, then decode engines
        assert r["free"] == [40, 40, 40] and r["compiles_after_warmup"] == 0, shape
        assert r["transfers"] == 10 and r["nbytes"] > 0, shape
