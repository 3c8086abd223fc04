"""The draft runner's record of which leading tokens have draft K/V (cbjax/runner/speculation/draft_runner.py).

A verifying step writes draft K/V up to its last draft; the target keeps only the accepted ones. When plain steps
or decode blocks follow (no drafts: adaptive k = 0, no n-gram match), the record must fall back to the target's
computed tokens, or the next verifying step would trust the rejected drafts' K/V at positions the target has since
filled with other tokens (lower acceptance, never wrong outputs, so the token-exact tests cannot see it)."""

import pytest

from cbjax import LLMEngine, SamplingParams
from cbjax.core.request import Request
from cbjax.core.scheduler_output import ScheduledSeq, SchedulerOutput
from tests.test_draft_model_engine import draft_spec
from tests.test_policy_engine_exact import OPTS, model  # noqa: F401 (fixture)


@pytest.fixture(scope="module")
def draft(model):  # noqa: F811
    return LLMEngine(model, speculative_config=draft_spec(model, k=3), **OPTS).runner.draft


def step(req, computed: int, drafts=()) -> SchedulerOutput:
    seq = ScheduledSeq(req, computed, 1 + len(drafts), True, draft_token_ids=list(drafts))
    return SchedulerOutput(seqs=[seq], num_batched_tokens=seq.num_new_tokens, preempted=[], time=0.0)


def test_a_plain_step_after_a_rejection_forgets_the_rejected_drafts_kv(draft):
    req = Request("r", list(range(3, 23)), SamplingParams(max_tokens=8), 0.0, seed=0, arrival_order=0)
    draft.computed[req] = 20  # the whole prompt is in the draft's cache: the verify step needs no catch-up
    draft.before_step(step(req, 20, drafts=[5, 6, 7]), verify=True)
    assert draft.computed[req] == 24  # its last token and three drafts written
    # One draft accepted: the target computed tokens 20 and 21, its next step starts at 22 with no drafts.
    draft.before_step(step(req, 22), verify=False)
    assert draft.computed[req] == 22  # positions 22 and 23 held rejected drafts' K/V
    draft.before_step(step(req, 23), verify=False)
    assert draft.computed[req] == 22  # a plain step writes no draft K/V: the record never grows on its own


def test_a_preempted_request_starts_again_from_nothing(draft):
    req = Request("p", list(range(3, 23)), SamplingParams(max_tokens=8), 0.0, seed=0, arrival_order=1)
    draft.computed[req] = 20
    out = step(req, 20)
    out.preempted.append(req)
    draft.before_step(out, verify=False)
    assert req not in draft.computed
