"""Preemption for a slot on the real engine: with the slots full of low-priority requests and pages to spare,
high-priority arrivals preempt them (priority's `preempt_for_slot`, on) or wait (off). Either way the greedy
tokens equal the full-forward reference: a request preempted for a slot resumes with its context intact.
(The scheduler alone, step by step: tests/core/test_slot_preemption.py.)"""

import numpy as np
import pytest

from cbjax import LLMEngine, SamplingParams
from cbjax.model import get_model_config, init_model
from tests.helpers import greedy_reference

MAX_MODEL_LEN = 96
# Two slots and 64 pages of 16 tokens: the slots run out, the pages never do.
OPTS = dict(
    max_num_seqs=2, max_num_batched_tokens=64, page_size=16, max_model_len=MAX_MODEL_LEN, num_pages=64,
    watermark_fraction=0.0,
)  # fmt: skip


@pytest.fixture(scope="module")
def model():
    return init_model(get_model_config("test-tiny"), seed=0)


@pytest.fixture(scope="module")
def workload(model):
    """Four long low-priority requests, then (once they run) three short high-priority ones, a step apart."""
    rng = np.random.default_rng(3)
    V = model.cfg.vocab_size
    low = [dict(prompt=rng.integers(3, V, 20 + 5 * i).tolist(), max_tokens=24, priority=1) for i in range(4)]
    high = [dict(prompt=rng.integers(3, V, 6 + i).tolist(), max_tokens=4, priority=0) for i in range(3)]
    reqs = low + high
    ref = greedy_reference(model, [r["prompt"] for r in reqs], [r["max_tokens"] for r in reqs], width=MAX_MODEL_LEN)
    return reqs, ref


@pytest.mark.parametrize("preempt_for_slot", [True, False])
def test_greedy_tokens_are_the_same_with_and_without_preemption_for_a_slot(model, workload, preempt_for_slot):
    reqs, ref = workload
    engine = LLMEngine(
        model, policy="priority", policy_options=dict(aging_s=None, preempt_for_slot=preempt_for_slot), **OPTS
    )
    engine.wait_until_warm()
    compiles = engine.num_compiles
    got = {}

    def step():
        got.update({int(o.request_id): o.outputs[0].token_ids for o in engine.step() if o.finished})

    for i, r in enumerate(reqs):
        params = SamplingParams(max_tokens=r["max_tokens"], temperature=0.0, ignore_eos=True)
        engine.add_request(str(i), r["prompt"], params, priority=r["priority"])
        if i >= 3:  # the low ones are all queued; each high one arrives while the slots are full
            for _ in range(3):
                step()
    while engine.has_unfinished_requests():
        step()
    assert [got.get(i) for i in range(len(reqs))] == ref
    assert engine.num_compiles == compiles, "compiled after warmup"
    sched = engine.scheduler
    assert sched.pool.num_free == sched.pool.num_pages
    if preempt_for_slot:
        assert sched.num_preemptions >= 3  # each high arrival took a low one's slot
    else:
        assert sched.num_preemptions == 0  # pages never ran out: nobody was preempted
