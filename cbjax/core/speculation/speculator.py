"""The scheduler's speculation hook: how many drafts this step, the drafts of one sequence, and the tallies.

Pure Python (numpy for the proposer). The scheduler asks `begin_step` once per step, then `drafts(req, limit)` for
each decode it schedules; after the step, `record(num_drafts, num_accepted)` per verified sequence. Verification
itself happens on the device (cbjax/runner/speculation/verification.py); the scheduler advances each sequence
by what it accepted.
"""

import numpy as np

from cbjax.core.request import Request
from cbjax.core.speculation.config import SpeculativeConfig
from cbjax.core.speculation.draft_length import DraftLengthRule, make_draft_length_rule
from cbjax.core.speculation.ngram import NgramProposer


class Speculator:
    def __init__(self, config: SpeculativeConfig, rule: DraftLengthRule | None = None, proposer=None):
        self.config = config
        self.max_drafts = config.num_speculative_tokens
        self.rule = rule if rule is not None else make_draft_length_rule(config)
        # Anything with propose(context, k) -> list[int] (tests plug in their own).
        if proposer is None:
            ngram = config.method == "ngram"
            proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max) if ngram else DeviceDrafts()
        self.proposer = proposer
        self.step_drafts = 0  # k for the step being scheduled
        # Cumulative tallies: drafts proposed and accepted, and both by draft position (index 0 = first draft).
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_verified_seqs = 0  # sequence-steps that verified at least one draft
        self.drafted_by_position = np.zeros(self.max_drafts, np.int64)
        self.accepted_by_position = np.zeros(self.max_drafts, np.int64)

    @staticmethod
    def batch_size(sched) -> int:
        """The batch size the draft-length rule goes by: the sequences running and waiting, up to the slots. While a
        batch fills up (a few sequences running, many waiting) it is already the batch it is about to be: a large
        batch drafts nothing from its first steps on."""
        return min(len(sched.running) + len(sched.waiting), sched.config.max_num_seqs)

    def wants_drafts(self, batch_size: int) -> bool:
        """Whether a step with this many running sequences would verify drafts (the engine then lets every token
        reach the host before scheduling it: proposals need the latest tokens)."""
        return min(self.rule.num_drafts(batch_size), self.max_drafts) > 0

    def begin_step(self, batch_size: int) -> int:
        self.step_drafts = min(self.rule.num_drafts(batch_size), self.max_drafts)
        return self.step_drafts

    def drafts(self, req: Request, limit: int) -> list[int]:
        """Up to min(step's k, limit) draft tokens continuing `req`'s context (every token of it known); for a
        structured-output request, only the leading ones its grammar accepts (`grammar_prefix`)."""
        k = min(self.step_drafts, limit)
        if k <= 0:
            return []
        if not getattr(self.proposer, "needs_context", True):  # a draft model's placeholders (DeviceDrafts)
            return self.proposer.propose(None, k)
        drafts = self.proposer.propose(context_array(req), k)
        return drafts if req.constraint is None else grammar_prefix(req.constraint, drafts)

    def record(self, num_drafts: int, num_accepted: int) -> None:
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        self.num_verified_seqs += 1
        self.drafted_by_position[:num_drafts] += 1
        self.accepted_by_position[:num_accepted] += 1

    def tally(self) -> tuple:
        """The cumulative counts before a step's results are received (for `step_record`)."""
        return (
            self.num_accepted_tokens,
            self.num_verified_seqs,
            self.drafted_by_position.copy(),
            self.accepted_by_position.copy(),
        )

    def step_record(self, before: tuple, num_draft_tokens: int, num_tokens: int, seconds: float) -> dict:
        """After a step's results were received: hand its acceptance by position and its cost to the draft-length
        rule (it may learn from them); returns the step's fields for the engine's step record."""
        accepted, verified, drafted_by_position, accepted_by_position = before
        drafted_by_position = (self.drafted_by_position - drafted_by_position).tolist()
        accepted_by_position = (self.accepted_by_position - accepted_by_position).tolist()
        self.rule.observe_acceptance(drafted_by_position, accepted_by_position)
        if num_tokens:
            self.rule.observe_step(num_tokens, seconds)
        return dict(
            # (A speculative block's drafts are proposed on the device, none in its plan: its tallies count them.)
            spec_draft_tokens=num_draft_tokens or sum(drafted_by_position),
            spec_accepted_tokens=self.num_accepted_tokens - accepted,
            spec_verified_seqs=self.num_verified_seqs - verified,
            spec_drafted_by_position=drafted_by_position,
            spec_accepted_by_position=accepted_by_position,
        )

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0


class DeviceDrafts:
    """A draft model's drafts are proposed on the device, inside the verifying step (cbjax/runner/
    draft_proposals.py): the scheduler only reserves their positions (budget, pages) with placeholders, and the
    step returns the accepted drafts' values with its sampled token."""

    PLACEHOLDER = 0
    needs_context = False

    def propose(self, context, k: int) -> list[int]:
        return [self.PLACEHOLDER] * k


def grammar_prefix(constraint, drafts: list[int]) -> list[int]:
    """The leading drafts a structured-output constraint (at the request's committed outputs) accepts, one by one:
    the rest would be rejected by the verify rows' masks anyway (cbjax/runner/speculation/constrained_verify.py),
    so they are not verified at all. The constraint is rolled back to where it was."""
    taken = 0
    try:
        for token in drafts:
            try:
                constraint.accept([int(token)])
            except ValueError:  # the grammar refuses it here
                break
            taken += 1
    finally:
        constraint.rollback(taken)
    return list(drafts[:taken])


def context_array(req: Request) -> np.ndarray:
    """`req`'s context as an int array, kept on the request and extended by the tokens added since the last call:
    converting a long context from the list at every step would cost more than the lookup. Only called when every
    token is known (no pending placeholder), and known tokens never change, so the copied prefix stays valid."""
    buf, n = req.spec_context if req.spec_context is not None else (np.empty(0, np.int32), 0)
    size = req.num_tokens
    if size < n:  # (outputs dropped: not while the request runs, but cheap to be safe)
        buf, n = np.empty(0, np.int32), 0
    if size > buf.shape[0]:
        grown = np.empty(max(2 * buf.shape[0], size + 64), np.int32)
        grown[:n] = buf[:n]
        buf = grown
    buf[n:size] = req.all_token_ids[n:size]
    req.spec_context = (buf, size)
    return buf[:size]
