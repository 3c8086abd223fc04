"""Speculative decoding on the real engine: greedy outputs equal the outputs without speculation token for token
(every policy, both preemption modes, the prefix cache on, a pool small enough to preempt), nothing leaks, nothing
compiles after warmup; stop tokens inside accepted drafts; the n-gram proposer end to end; sampled outputs keep
their seeds' tokens."""

import numpy as np
import pytest

from cbjax import LLM, LLMEngine, SamplingParams
from cbjax.bench.metrics import StepRecord, acceptance_by_position, step_summary
from cbjax.core.policy_zoo import POLICIES
from tests.test_policy_engine_exact import MAX_MODEL_LEN, OPTS, model, run_staggered, workload  # noqa: F401 (fixtures)

K = 3
SPEC = {"method": "ngram", "num_speculative_tokens": K}


class ReferenceProposer:
    """Drafts the known greedy continuation of each prompt, with every third position wrong: drafts are accepted,
    rejected at every position, and cut short near the end of the reference."""

    def __init__(self, prompts, continuations):
        self.full = [(list(p), list(p) + list(c)) for p, c in zip(prompts, continuations)]

    def propose(self, context, k):
        ctx = [int(t) for t in context]
        for prompt, full in self.full:
            if len(ctx) <= len(full) and ctx == full[: len(ctx)] and ctx[: len(prompt)] == prompt:
                n = len(ctx)
                return [t if (n + i) % 3 else (t + 1) % 512 for i, t in enumerate(full[n : n + k])]
        return []


def engine_with_reference_drafts(model, prompts, ref, **options):  # noqa: F811
    engine = LLMEngine(model, speculative_config=SPEC, **options)
    engine.scheduler.speculator.proposer = ReferenceProposer(prompts, ref)
    return engine


def check_clean(engine, compiles):
    assert engine.num_compiles == compiles, "compiled after warmup"
    sched = engine.scheduler
    assert sched.pool.num_free == sched.pool.num_pages, "page leak"
    sched.pool.check_consistent()
    if sched.host_pool is not None:
        assert sched.host_pool.num_free == sched.host_pool.num_pages


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_every_policy_is_token_exact_with_drafts_under_preemption(model, workload, policy, mode):  # noqa: F811
    reqs, ref = workload
    prompts = [r["prompt"] for r in reqs]
    engine = engine_with_reference_drafts(
        model,
        prompts,
        ref,
        policy=policy,
        preemption_mode=mode,
        num_host_pages=64 if mode == "swap" else None,
        enable_prefix_caching=True,
        **OPTS,
    )
    check_exact_with_drafts_under_preemption(engine, reqs, ref, f"{policy}/{mode}")


def check_exact_with_drafts_under_preemption(engine, reqs, ref, label: str) -> None:
    """The workload's greedy outputs equal the reference; preemptions and prefix hits happened; drafts passed and
    failed; nothing leaked or compiled after warmup; the step records add up to the speculator's tallies."""
    engine.wait_until_warm()
    compiles = engine.num_compiles
    got = run_staggered(engine, reqs)
    mismatches = [i for i in range(len(reqs)) if got.get(i) != ref[i]]
    shown = [(got.get(i), ref[i]) for i in mismatches[:2]]
    assert not mismatches, f"{label}: requests {mismatches} differ: {shown}"
    check_clean(engine, compiles)
    sched, spec = engine.scheduler, engine.scheduler.speculator
    assert sched.num_preemptions > 0, "the small pool was meant to force preemption"
    assert sched.pool.hit_tokens > 0, "the shared prefixes were meant to hit the cache"
    assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens, "drafts were meant to pass and fail"
    steps = engine.step_records
    assert sum(s["spec_draft_tokens"] for s in steps) == spec.num_draft_tokens
    assert sum(s["spec_accepted_tokens"] for s in steps) == spec.num_accepted_tokens


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_stop_tokens_inside_accepted_drafts_end_the_request_there(model, workload, async_scheduling):  # noqa: F811
    reqs, ref = workload
    prompts = [r["prompt"] for r in reqs]
    cut = [(i, r) for i, r in enumerate(ref) if len(r) >= 4]
    stops = [r[len(r) // 2] for _, r in cut]
    want = [r[: r.index(t) + 1] for (_, r), t in zip(cut, stops)]
    params = [
        SamplingParams(max_tokens=reqs[i]["max_tokens"], temperature=0.0, ignore_eos=True, stop_token_ids=(t,))
        for (i, _), t in zip(cut, stops)
    ]
    engine = engine_with_reference_drafts(
        model, prompts, ref, async_scheduling=async_scheduling, **dict(OPTS, num_pages=64)
    )
    outs = LLM.from_engine(engine).generate([prompts[i] for i, _ in cut], params)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert all(o.outputs[0].finish_reason == "stop" for o in outs)
    assert engine.scheduler.pool.num_free == engine.scheduler.pool.num_pages
    assert engine.scheduler.speculator.num_accepted_tokens > 0


def test_ngram_drafts_end_to_end_equal_no_speculation_and_stream_every_token(model):  # noqa: F811
    """The real proposer on prompts that repeat themselves; the stream's deltas add up to the outputs."""
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 512, int(rng.integers(4, 12))).tolist() * 4 for _ in range(8)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    base = LLM(model, **dict(OPTS, num_pages=64)).generate(prompts, params)
    engine = LLMEngine(model, speculative_config=dict(SPEC, prompt_lookup_min=1), **dict(OPTS, num_pages=64))
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    streamed = {str(i): [] for i in range(len(prompts))}
    final = {}
    for out in engine.stream():
        streamed[out.request_id] += out.outputs[0].new_token_ids
        if out.finished:
            final[out.request_id] = out.outputs[0].token_ids
    want = [o.outputs[0].token_ids for o in base]
    assert [final[str(i)] for i in range(len(prompts))] == want
    assert [streamed[str(i)] for i in range(len(prompts))] == want
    spec = engine.scheduler.speculator
    assert spec.num_accepted_tokens > 0, "repeated prompts were meant to make n-gram drafts pass"
    assert engine.scheduler.pool.num_free == engine.scheduler.pool.num_pages
    # The step records add up to the speculator's tallies, and the summary's metrics follow from them.
    summary = step_summary([StepRecord(**s) for s in engine.step_records])
    assert summary["spec_draft_tokens"] == spec.num_draft_tokens
    assert summary["spec_acceptance_rate"] == pytest.approx(spec.num_accepted_tokens / spec.num_draft_tokens)
    length = 1 + spec.num_accepted_tokens / spec.num_verified_seqs
    assert summary["spec_mean_acceptance_length"] == pytest.approx(length)
    by_position = list(spec.accepted_by_position / spec.drafted_by_position)
    assert acceptance_by_position([StepRecord(**s) for s in engine.step_records]) == pytest.approx(by_position)
    assert [summary[f"spec_acceptance_pos{i + 1}"] for i in range(K)] == pytest.approx(by_position)


def test_sampled_outputs_keep_their_seeds_tokens_with_drafts(model, workload):  # noqa: F811
    """A row samples with its request's seed and output index, exactly as without speculation; a draft passes
    when it equals that sample. So sampled outputs are the same tokens with and without drafts (whatever k the
    step chose), and the drafts of the reference proposer are still accepted at temperature 0.3."""
    reqs, _ = workload
    prompts = [r["prompt"] for r in reqs]
    params = [
        SamplingParams(max_tokens=r["max_tokens"], temperature=0.3, top_k=20, top_p=0.95, seed=100 + i)
        for i, r in enumerate(reqs)
    ]
    opts = dict(OPTS, num_pages=64)
    base = [o.outputs[0].token_ids for o in LLM(model, **opts).generate(prompts, params)]
    engine = engine_with_reference_drafts(model, prompts, base, **opts)
    got = [o.outputs[0].token_ids for o in LLM.from_engine(engine).generate(prompts, params)]
    assert got == base
    assert engine.scheduler.speculator.num_accepted_tokens > 0
