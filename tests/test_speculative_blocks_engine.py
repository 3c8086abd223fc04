"""Adaptive speculation with blocks of decode steps on the real engine: steps whose draft-length rule chose no drafts
run as blocks (cbjax/core/multi_step.py), the others verify drafts, and the greedy tokens equal the full-forward
reference (seeded sampled tokens those of the engine without speculation), with nothing compiled after warmup."""

import pytest

from cbjax import LLMEngine, SamplingParams
from tests.test_multi_step_engine import OPTS, generate, model, workload  # noqa: F401 (fixtures)
from tests.test_speculative_engine import ReferenceProposer

# Drafts while at most 3 sequences run or wait, none above (then blocks): a 16-request run does both. One verify
# step per dispatch (device_blocks off: the reference proposer's drafts are verified; speculative blocks propose on
# the device, tests/test_speculative_device_blocks.py).
ADAPTIVE = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "draft_length": "batch_size",
    "draft_length_table": {"1-3": 3, "4-": 0},
    "device_blocks": False,
}


def adaptive_engine(model, prompts, ref, **options):  # noqa: F811
    engine = LLMEngine(model, num_scheduler_steps=4, speculative_config=ADAPTIVE, **OPTS, **options)
    engine.scheduler.speculator.proposer = ReferenceProposer(prompts, ref)  # (drafts right 2 times in 3)
    return engine


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_greedy_tokens_with_blocks_and_drafts_equal_full_forward(model, workload, async_scheduling):  # noqa: F811
    prompts, params, ref = workload
    engine = adaptive_engine(model, prompts, ref, async_scheduling=async_scheduling)
    got = generate(engine, prompts, params)  # (0 compiles after warmup, no page leak)
    assert [i for i, (g, r) in enumerate(zip(got, ref)) if g != r] == []
    records = engine.step_records
    assert any(s["decode_steps"] > 1 for s in records), "no block of decode steps ran"
    assert not any(s["decode_steps"] > 1 and s["spec_draft_tokens"] for s in records)
    spec = engine.scheduler.speculator
    assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens
    assert sum(s["spec_draft_tokens"] for s in records) == spec.num_draft_tokens


def test_seeded_sampling_with_blocks_and_drafts_equals_no_speculation(model, workload):  # noqa: F811
    prompts, _, ref = workload
    params = [
        SamplingParams(max_tokens=len(r), temperature=0.8, top_k=40, seed=7 + i, ignore_eos=True)
        for i, r in enumerate(ref)
    ]
    plain = generate(LLMEngine(model, num_scheduler_steps=4, **OPTS), prompts, params)
    engine = adaptive_engine(model, prompts, plain)  # drafts from the sampled outputs: some pass, some fail
    assert generate(engine, prompts, params) == plain
    assert any(s["decode_steps"] > 1 for s in engine.step_records)
    spec = engine.scheduler.speculator
    assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens
