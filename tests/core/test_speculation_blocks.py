"""Speculation and blocks of decode steps together, on the scheduler alone (the fake runner): a step without
drafts (the rule chose none, or the proposer found none) may become a block (cbjax/core/multi_step.py), a step with
drafts never does, and the outputs stay the reference tokens whatever the mix (every policy, both preemption
modes, aborts)."""

import dataclasses

from hypothesis import HealthCheck, given, settings

from cbjax.core import Request, SamplingParams, VirtualClock
from cbjax.core.request import PENDING_TOKEN
from cbjax.core.speculation.config import SpeculativeConfig
from cbjax.core.speculation.draft_length import DraftLengthRule
from cbjax.core.speculation.speculator import Speculator
from tests.core.fake_runner import assert_reference_outputs
from tests.core.scheduler_setup import FlatConfig, make_scheduler
from tests.core.test_policy_invariants import EOS, Case, admit_and_abort, cases, check_step
from tests.core.test_speculation import MostlyRightProposer, execute_with_drafts


class Alternating(DraftLengthRule):
    """k drafts on every third step, none on the others: blocks and verifying steps interleave in any run."""

    def __init__(self, k: int):
        self.max_drafts, self.calls = k, 0

    def num_drafts(self, batch_size: int) -> int:
        self.calls += 1
        return self.max_drafts if self.calls % 3 == 0 else 0


execute = execute_with_drafts  # (block-aware: a block's rows, step by step)


def run_mixed(case: Case, k: int, steps_per_block: int, seed: int):
    """Run the case synchronously with the Alternating rule and blocks on; returns the scheduler and each step's
    (num_steps, drafts)."""
    clock = VirtualClock()
    config = SpeculativeConfig(num_speculative_tokens=k)
    spec = Speculator(config, rule=Alternating(k), proposer=MostlyRightProposer(seed))
    cfg = dataclasses.replace(case.config, policy_options=case.policy_options, num_scheduler_steps=steps_per_block)
    s = make_scheduler(cfg, clock, speculator=spec)
    kv, reqs, expected = {}, {}, {}
    pending = sorted(enumerate(case.requests), key=lambda x: x[1][0])
    step, steps = 0, []
    while pending or s.has_unfinished():
        admit_and_abort(s, case, clock, step, pending, reqs, expected)
        out = s.schedule()
        assert out.num_steps == 1 or out.num_draft_tokens == 0
        steps.append((out.num_steps, out.num_draft_tokens))
        tokens = execute(kv, s, out)
        clock.advance(0.001)
        s.update(out, tokens, EOS, clock.now())
        check_step(s, out)
        for r in s.running:  # nothing of a block is left pending once it is received
            assert PENDING_TOKEN not in r.all_token_ids
        step += 1
        assert step < 5000, "requests did not finish"
    assert_reference_outputs(reqs, expected, s, case.config.num_pages)
    return s, steps


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_every_policy_with_drafts_and_blocks_finishes_with_reference_tokens(case):
    run_mixed(case, k=3, steps_per_block=4, seed=len(case.requests))


def test_blocks_run_where_the_rule_chose_no_drafts_and_drafts_still_pay():
    cfg = FlatConfig(max_num_seqs=4, max_num_batched_tokens=32, page_size=4, num_pages=60, max_model_len=60)
    reqs = [(0, list(range(1 + i, 6 + i)), 30, 0, "a", None, None) for i in range(4)]
    s, steps = run_mixed(Case(cfg, {}, reqs), k=3, steps_per_block=4, seed=1)
    assert any(n == 4 for n, _ in steps), "no block ran"
    assert any(d for _, d in steps), "no step verified drafts"
    spec = s.speculator
    assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens


def test_a_step_whose_proposer_found_nothing_may_be_a_block_and_one_with_drafts_never_is():
    """k > 0 and no draft for any sequence (no n-gram match): a block, as without speculation; drafts: one step."""

    class OnlyAfterTen:
        def propose(self, context, k):
            return [] if len(context) < 10 else [1] * k

    cfg = FlatConfig(max_num_seqs=2, max_num_batched_tokens=16, page_size=4, num_pages=40, max_model_len=40)
    s = make_scheduler(
        dataclasses.replace(cfg, num_scheduler_steps=4),
        VirtualClock(),
        speculator=Speculator(SpeculativeConfig(num_speculative_tokens=2), proposer=OnlyAfterTen()),
    )
    s.add(Request("a", [1, 2, 3], SamplingParams(max_tokens=20, ignore_eos=True), 0.0, 0, 0))
    kv, outs = {}, []
    while s.has_unfinished():
        out = s.schedule()
        outs.append(out)
        s.update(out, execute(kv, s, out), EOS, 0.0)
    assert any(o.num_steps > 1 for o in outs), "no block while nothing was drafted"
    assert any(o.num_draft_tokens for o in outs)
    assert all(o.num_steps == 1 for o in outs if o.num_draft_tokens)
