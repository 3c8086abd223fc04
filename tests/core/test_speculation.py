"""Speculative decoding in the pure-Python core: its options, the n-gram proposer, the draft-length rules, and the
scheduler's invariants with drafts (every policy, both preemption modes, the prefix cache, aborts, asynchronous
steps) on the fake runner, whose tokens depend on the KV read back through the page tables."""

import dataclasses
import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from cbjax.core import Scheduler, VirtualClock
from cbjax.core.request import PENDING_TOKEN
from cbjax.core.speculation.config import SpeculativeConfig
from cbjax.core.speculation.draft_length import BatchSizeDraftLength, MeasuredDraftLength
from cbjax.core.speculation.ngram import NgramProposer
from cbjax.core.speculation.speculator import Speculator
from cbjax.engine_config import EngineConfig
from tests.core.fake_runner import assert_reference_outputs, block_rows, next_token
from tests.core.scheduler_setup import FlatConfig, make_scheduler
from tests.core.test_policy_invariants import EOS, VOCAB, Case, admit_and_abort, cases, check_step


# ---- options ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "bad, message",
    [
        (dict(num_speculative_tokens=0), "num_speculative_tokens must be an integer >= 1"),
        (dict(num_speculative_tokens=2.0), "num_speculative_tokens must be an integer"),
        (dict(method="medusa"), "method must be one of"),
        (dict(prompt_lookup_min=0), "prompt_lookup_min must be an integer >= 1"),
        (dict(prompt_lookup_min=5, prompt_lookup_max=3), r"prompt_lookup_min \(5\) > prompt_lookup_max \(3\)"),
        (dict(method="draft"), "needs draft_model"),
        (dict(method="draft", draft_model=""), "draft_model must be a non-empty string"),
        (dict(method="draft", draft_model=3), "must be a model name or path"),
        (dict(method="draft", draft_model="tinypy-draft"), None),  # the draft is checked against the model later
        (dict(draft_model="tinypy-draft"), "draft_model is for method='draft'"),
        (dict(acceptance="greedy"), "acceptance must be one of"),
        (dict(acceptance="rejection_sampling"), "is for method='draft'"),
        (dict(num_tokens=3), r"unknown field\(s\) \['num_tokens'\]"),
        (dict(draft_length="batch_size"), "needs draft_length_table"),
        (dict(draft_length="batch_size", draft_length_table={"1-8": 4, "10-": 0}), "without gaps"),
        (dict(draft_length="batch_size", draft_length_table={"1-8": 4, "9-16": 0}), "last range must be open"),
        (dict(draft_length="batch_size", draft_length_table={"1-": 5}), r"\[1-\] must be an integer >= 0 and <= 4"),
        (dict(draft_length_table={"1-": 2}), "is for draft_length='batch_size'"),
    ],
)
def test_bad_speculative_configs_are_refused_by_the_engine_config(bad, message):
    if message is None:
        assert EngineConfig.from_options(speculative_config=bad).speculative.draft_model == "tinypy-draft"
        return
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_options(speculative_config=bad)


def test_speculative_config_parses_the_batch_size_table_and_refuses_the_simulator():
    cfg = EngineConfig.from_options(
        speculative_config=dict(draft_length="batch_size", draft_length_table={"9-32": 2, "1-8": 4, "33-": 0})
    ).speculative
    assert cfg.draft_length_table == ((1, 8, 4), (9, 32, 2), (33, None, 0))
    assert cfg.to_dict()["draft_length_table"] == {"1-8": 4, "9-32": 2, "33-": 0}
    rule = BatchSizeDraftLength(cfg.draft_length_table)
    assert [rule.num_drafts(b) for b in (1, 8, 9, 32, 33, 500)] == [4, 4, 2, 2, 0, 0]
    with pytest.raises(ValueError, match="not supported by the simulator"):
        EngineConfig.from_options(runner="sim", sim_accelerator="h100", speculative_config={"method": "ngram"})


# ---- the n-gram proposer ------------------------------------------------------------------------------------------
def naive_propose(ctx: list[int], k: int, lo: int, hi: int) -> list[int]:
    """The same rule written plainly: the longest suffix n-gram (hi..lo) with an earlier occurrence; among its
    occurrences the latest with k tokens after it, else the earliest."""
    L = len(ctx)
    for n in range(min(hi, L - 1), lo - 1, -1):
        suffix = ctx[L - n :]
        starts = [i for i in range(L - n) if ctx[i : i + n] == suffix]
        if starts:
            full = [i for i in starts if i + n + k <= L]
            i = full[-1] if full else starts[0]
            return ctx[i + n : i + n + k]
    return []


def test_ngram_proposer_matches_the_plain_rule_on_random_contexts():
    rng = np.random.default_rng(0)
    proposer = NgramProposer(2, 4)
    for _ in range(2000):
        ctx = rng.integers(0, int(rng.integers(2, 6)), int(rng.integers(1, 40))).tolist()
        k = int(rng.integers(1, 6))
        assert proposer.propose(ctx, k) == naive_propose(ctx, k, 2, 4), ctx
    assert NgramProposer(2, 4).propose([1, 2, 3, 4, 5, 1, 2, 3], 3) == [4, 5, 1]
    assert NgramProposer(3, 3).propose([9, 2, 3, 4, 5, 1, 2, 3], 3) == []  # only a 2-gram matches


# ---- draft-length rules -------------------------------------------------------------------------------------------
def test_measured_rule_drafts_when_it_pays_and_not_when_it_hurts():
    cheap = MeasuredDraftLength(4)  # a step costs the same whatever its tokens (a memory-bound device)
    for n in (4, 8, 20, 40):
        cheap.observe_step(n, 0.010)
    cheap.observe_acceptance([100] * 4, [70, 60, 50, 40])
    assert cheap.num_drafts(4) == 4
    costly = MeasuredDraftLength(4)  # cost proportional to tokens (compute-bound) and poor acceptance
    for n in (16, 32, 64, 128, 256):
        costly.observe_step(n, 0.001 * n)
    costly.observe_acceptance([100] * 4, [10, 2, 1, 0])
    assert costly.num_drafts(64) == 0


# ---- the scheduler with drafts, on the fake runner ----------------------------------------------------------------
class MostlyRightProposer:
    """Drafts the true continuation (the fake model is known), every draft wrong with probability 1/3 and
    sometimes fewer of them: both acceptance and rejection happen at every position."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)

    def propose(self, context, k: int) -> list[int]:
        ctx, out = [int(t) for t in context], []
        assert PENDING_TOKEN not in ctx, "drafts proposed for a context with a pending token"
        for _ in range(self.rng.randint(0, k)):
            t = next_token(tuple((tok, i) for i, tok in enumerate(ctx)), VOCAB)
            t = t if self.rng.random() < 2 / 3 else (t + 1) % VOCAB
            out.append(t)
            ctx.append(t)
        return out


def execute_with_drafts(kv: dict, sched: Scheduler, out) -> list:
    """The fake runner's step (tests/core/fake_runner.py) with verification: swaps first, then every token of every
    chunk (drafts included) is written into the KV pages; each sampling row reads its context back through the page
    table. A drafted sequence returns its
    accepted drafts and the token sampled at its first rejected row (or the bonus token); a block of decode steps
    (no drafts, cbjax/core/multi_step.py) a row of tokens per step."""
    G = sched.cache.page_size
    for dev, host in out.swap_out:
        for o in range(G):
            kv["host", host, o] = kv.get((dev, o))
    for host, dev in out.swap_in:
        for o in range(G):
            kv[dev, o] = kv.pop(("host", host, o))
    result = []
    for seq in out.seqs:
        r, c, k = seq.request, seq.num_computed_tokens, seq.num_new_tokens
        chunk = r.all_token_ids[c : c + k - len(seq.draft_token_ids)] + list(seq.draft_token_ids)
        assert PENDING_TOKEN not in chunk, "the fake runner is driven synchronously here"
        for pos, token in zip(range(c, c + k), chunk):
            page = r.pages[pos // G]
            assert sched.pool.refcount(page) == 1, f"{r.request_id} writes position {pos} into a shared page"
            kv[page, pos % G] = (token, pos)

        def sample_at(end: int, r=r) -> int:
            ctx = tuple(kv.get((r.pages[p // G], p % G)) for p in range(end))
            return next_token(ctx, VOCAB) if None not in ctx else -2

        end = c + k - len(seq.draft_token_ids)
        if not seq.draft_token_ids:
            result.append(sample_at(end))
            continue
        tokens = []
        for j, draft in enumerate([*seq.draft_token_ids, None]):
            y = sample_at(end + j)
            tokens.append(y)
            if y != draft:
                break
        result.append(tokens)
    if out.num_steps == 1:
        return result
    return block_rows(out, result, kv, G, VOCAB)  # a block of decode steps (a step without drafts)


def run_case_with_drafts(case: Case, k: int, seed: int) -> tuple[Scheduler, list]:
    """Run the case synchronously; returns the scheduler and each step's (sequences, decodes, drafts)."""
    clock = VirtualClock()
    spec = Speculator(SpeculativeConfig(num_speculative_tokens=k), proposer=MostlyRightProposer(seed))
    s = make_scheduler(dataclasses.replace(case.config, policy_options=case.policy_options), clock, speculator=spec)
    kv: dict = {}
    reqs, expected = {}, {}
    pending = sorted(enumerate(case.requests), key=lambda x: x[1][0])
    step, steps = 0, []
    while pending or s.has_unfinished():
        admit_and_abort(s, case, clock, step, pending, reqs, expected)
        out = s.schedule()
        for seq in out.seqs:  # unverified drafts are never counted as computed
            assert seq.request.num_computed_tokens <= seq.request.num_tokens
        decodes = sum(q.request.num_computed_tokens + 1 == q.request.num_tokens for q in out.seqs)
        steps.append((len(out.seqs), decodes, out.num_draft_tokens))
        tokens = execute_with_drafts(kv, s, out)
        clock.advance(0.001)
        s.update(out, tokens, EOS, clock.now())
        check_step(s, out)
        step += 1
        assert step < 5000, "requests did not finish"
    assert_reference_outputs(reqs, expected, s, case.config.num_pages)
    if s.host_pool is not None:
        assert s.host_pool.num_free == s.host_pool.num_pages
    return s, steps


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_every_policy_with_drafts_finishes_with_reference_tokens(case):
    run_case_with_drafts(case, k=3, seed=len(case.requests))


def test_drafts_are_accepted_rejected_and_trimmed_to_the_budget():

    cfg = FlatConfig(max_num_seqs=4, max_num_batched_tokens=8, page_size=4, num_pages=40, max_model_len=40)
    reqs = [(0, list(range(1 + i, 6 + i)), 20, 0, "a", None, None) for i in range(4)]
    s, steps = run_case_with_drafts(Case(cfg, {}, reqs), k=4, seed=1)
    spec = s.speculator
    assert spec.num_accepted_tokens > 0 and spec.num_accepted_tokens < spec.num_draft_tokens
    assert (spec.accepted_by_position > 0).all()
    # 4 decoding sequences and a budget of 8: the drafts are trimmed to the 4 tokens left, no decode is left out.
    full = [(n, d, drafts) for n, d, drafts in steps if d == 4]
    assert full and all(n == 4 and drafts <= 4 for n, _, drafts in full)
    assert max(drafts for *_, drafts in full) == 4
