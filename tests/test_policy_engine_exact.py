"""Every policy on the real engine, in both preemption modes with the prefix cache on, under a KV pool small enough
to force preemption: greedy tokens equal the full-forward reference, nothing leaks, nothing compiles after warmup.
(The same invariants over thousands of random small cases, without a model: tests/core/test_policy_invariants.py.)
"""

import numpy as np
import pytest

from cbjax import LLM, LLMEngine, SamplingParams
from cbjax.core.policy_zoo import POLICIES
from cbjax.model import get_model_config, init_model
from tests.helpers import greedy_reference

MAX_MODEL_LEN = 176
# All engines share these shapes, so the step programs compile once for the whole module.
OPTS = dict(
    max_num_seqs=6,
    max_num_batched_tokens=64,
    page_size=16,
    max_model_len=MAX_MODEL_LEN,
    num_pages=16,
    watermark_fraction=0.0,
)


@pytest.fixture(scope="module")
def model():
    return init_model(get_model_config("test-tiny"), seed=0)


@pytest.fixture(scope="module")
def workload(model):
    """16 requests: half start with one of two 48-token prefixes (3 full pages), so the cache has hits."""
    rng = np.random.default_rng(7)
    V = model.cfg.vocab_size
    prefixes = [rng.integers(3, V, 48).tolist() for _ in range(2)]
    reqs = []
    for i in range(16):
        suffix = rng.integers(3, V, int(rng.integers(1, 60))).tolist()
        prompt = prefixes[i % 2] + suffix if i % 2 == 0 or i < 8 else suffix + suffix[:20]
        reqs.append(
            dict(
                prompt=prompt,
                max_tokens=int(rng.integers(1, 33)),
                priority=int(rng.integers(0, 3)),
                tenant="abc"[i % 3],
                deadline=float(rng.uniform(0.0, 2.0)),
            )
        )
    ref = greedy_reference(model, [r["prompt"] for r in reqs], [r["max_tokens"] for r in reqs], width=MAX_MODEL_LEN)
    return reqs, ref


def run_staggered(engine, reqs) -> dict[int, list[int]]:
    """Greedy outputs by request index. Staggered arrivals (a step after every 4 requests): later requests join a
    running batch and outrank running ones in some policies."""
    got = {}
    for i, r in enumerate(reqs):
        engine.add_request(
            str(i),
            r["prompt"],
            SamplingParams(max_tokens=r["max_tokens"], temperature=0.0, ignore_eos=True),
            priority=r["priority"],
            tenant=r["tenant"],
            deadline=r["deadline"],
        )
        if i % 4 == 3:
            got |= {int(o.request_id): o.outputs[0].token_ids for o in engine.step() if o.finished}
    while engine.has_unfinished_requests():
        got |= {int(o.request_id): o.outputs[0].token_ids for o in engine.step() if o.finished}
    return got


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_every_policy_is_token_exact_under_preemption(model, workload, policy, mode):
    reqs, ref = workload
    engine = LLMEngine(
        model,
        policy=policy,
        preemption_mode=mode,
        num_host_pages=64 if mode == "swap" else None,
        enable_prefix_caching=True,
        **OPTS,
    )
    engine.wait_until_warm()
    compiles = engine.num_compiles
    got = run_staggered(engine, reqs)
    mismatches = [i for i in range(len(reqs)) if got.get(i) != ref[i]]
    assert not mismatches, (
        f"{policy}/{mode}: requests {mismatches} differ from the full-forward reference: "
        f"{[(got.get(i), ref[i]) for i in mismatches[:2]]}"
    )
    assert engine.num_compiles == compiles, "compiled after warmup"
    sched = engine.scheduler
    assert sched.pool.num_free == sched.pool.num_pages, "page leak"
    sched.pool.check_consistent()
    assert sched.num_preemptions > 0, "the small pool was meant to force preemption"
    assert sched.pool.hit_tokens > 0, "the shared prefixes were meant to hit the cache"
    steps = engine.step_records
    if mode == "swap":
        assert sched.num_swapped_in_pages == sched.num_swapped_out_pages > 0
        assert sched.host_pool.num_free == sched.host_pool.num_pages
        moved = sum(s["swap_out_bytes"] + s["swap_in_bytes"] for s in steps)
        assert moved == 2 * sched.num_swapped_out_pages * engine.runner.host_pool.bytes_per_page
    else:
        assert sum(s["recomputed_tokens"] for s in steps) == sched.num_recomputed_tokens > 0


def test_llm_facade_takes_any_policy_and_its_options(model):
    prompts = [[5, 6, 7] * 20, [9, 8] * 30, [11] * 40]
    ref = greedy_reference(model, prompts, [12] * 3, width=MAX_MODEL_LEN)
    llm = LLM(
        model,
        policy="mlfq",
        policy_options={"quantum": 8, "victim": "longest_running"},
        preemption_mode="swap",
        num_host_pages=8,
        enable_prefix_caching=True,
        **OPTS,
    )
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert llm.engine.scheduler.policy.quantum == 8 and llm.engine.scheduler.policy.victim == "longest_running"
