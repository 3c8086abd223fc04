"""Data parallelism: routers (pure Python), and DataParallelEngine's replicas on fake CPU devices producing the
tokens one engine produces, each on its own device, with no page leak and nothing compiled after warmup."""

import pytest

from cbjax import LLM, SamplingParams
from cbjax.core.routers import LeastLoadRouter, PrefixAffinityRouter, RoundRobinRouter, make_router
from cbjax.data_parallel import DataParallelEngine
from cbjax.model import get_model_config, init_model
from tests.helpers import drain, run_on_fake_devices

OPTS = dict(max_num_seqs=4, max_num_batched_tokens=32, page_size=8, num_pages=40, max_model_len=96)
GREEDY = dict(temperature=0.0, ignore_eos=True)


def test_routers_choose_as_described():
    rr = RoundRobinRouter()
    assert [rr.choose([1], [9, 0, 0]) for _ in range(5)] == [0, 1, 2, 0, 1]
    assert LeastLoadRouter().choose([1], [5, 3, 3]) == 1
    pa = PrefixAffinityRouter(prefix_tokens=4, balance_ratio=2.0, balance_slack=10)
    a, b = [7, 8, 9, 10, 1], [7, 8, 9, 10, 2]  # the same first 4 tokens
    assert pa.choose(a, [0, 0, 0]) == pa.choose(b, [0, 0, 0])
    home = pa.choose(a, [0, 0, 0])
    loads = [0, 0, 0]
    loads[home] = 11  # > 2 x 0 + 10: too busy, the least loaded replica instead
    assert pa.choose(a, loads) != home
    loads[home] = 10
    assert pa.choose(a, loads) == home


@pytest.mark.parametrize(
    "name, options, message",
    [
        ("random", None, "router must be one of"),
        ("prefix_affinity", {"prefix_tokens": 0}, "prefix_tokens must be an integer >= 1"),
        ("round_robin", {"bogus": 1}, "router 'round_robin'"),
    ],
)
def test_bad_routers_are_refused(name, options, message):
    with pytest.raises(ValueError, match=message):
        make_router(name, options)


@pytest.fixture(scope="module")
def dp_engine():
    model = init_model(get_model_config("test-tiny"), seed=0)
    return DataParallelEngine(model, data_parallel_size=2, router="round_robin", **OPTS)


def test_requests_are_owned_by_one_replica_and_ids_are_unique_across_them(dp_engine):
    e = dp_engine
    e.add_request("a", [5, 6, 7], SamplingParams(max_tokens=30, **GREEDY))
    e.add_request("b", [8, 9], SamplingParams(max_tokens=30, **GREEDY))  # round robin: the other replica
    assert "a" in e.replicas[0].requests and "b" in e.replicas[1].requests and set(e.requests) == {"a", "b"}
    with pytest.raises(ValueError, match="duplicate request id"):
        e.add_request("a", [5], SamplingParams())
    with pytest.raises(ValueError, match="empty prompt"):
        e.add_request("c", [], SamplingParams())  # refused by its replica, nothing else disturbed
    e.step()
    e.abort_request("b")
    with pytest.raises(ValueError, match="unknown request id"):
        e.abort_request("zz")
    done = drain(e)
    assert done["b"].outputs[0].finish_reason == "abort" and len(done["a"].outputs[0].token_ids) == 30
    assert not e.has_unfinished_requests() and all(r.scheduler.pool.num_free == 40 for r in e.replicas)
    assert {rec["replica"] for rec in e.step_records} == {0, 1}


def test_llm_validates_data_parallel_size():
    with pytest.raises(ValueError, match="data_parallel_size must be an integer >= 1"):
        LLM("test-tiny", data_parallel_size=True)


SCRIPT = """
import json, os
from cbjax import LLM
from cbjax.model import get_model_config, init_model
from tests.helpers import random_workload

opts = {opts!r}
model = init_model(get_model_config("test-tiny"), seed=0)
prompts, params = random_workload(12, seed=3, vocab=512, prompt_range=(1, 60), max_tokens_range=(1, 20))
ref = [o.outputs[0].token_ids for o in LLM(model, **opts).generate(prompts, params)]
report = {{}}
for router in ("round_robin", "least_load", "prefix_affinity"):
    llm = LLM(model, data_parallel_size=2, router=router, warmup="full", **opts)
    e = llm.engine
    warm = e.num_compiles
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    report[router] = dict(
        same=got == ref,
        routed=e.num_routed,
        param_devices=[sorted(d.id for d in r.runner.params[0].devices()) for r in e.replicas],
        kv_devices=[sorted(d.id for d in r.runner.kv_caches[0][0].devices()) for r in e.replicas],
        free=[r.scheduler.pool.num_free for r in e.replicas],
        compiles_after_warmup=e.num_compiles - warm,
    )
print("REPORT " + json.dumps(report))
"""


def test_two_replicas_on_fake_devices_generate_one_engines_tokens():
    report = run_on_fake_devices(SCRIPT.format(opts=OPTS), 8)  # replicas on devices 0 and 1 of 8
    for router, r in report.items():
        assert r["same"], router  # greedy tokens equal one engine's, token for token
        assert r["param_devices"] == [[0], [1]] and r["kv_devices"] == [[0], [1]], router
        assert r["free"] == [40, 40] and r["compiles_after_warmup"] == 0, router
        assert sum(r["routed"]) == 12 and min(r["routed"]) > 0, router
    assert report["round_robin"]["routed"] == [6, 6]
