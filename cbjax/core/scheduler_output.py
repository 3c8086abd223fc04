"""What the scheduler hands the runner for one step: the sequences, how many tokens each, and the KV swaps."""

import dataclasses

from cbjax.core.request import Request


@dataclasses.dataclass(slots=True)
class ScheduledSeq:
    """One sequence of a step: it computes tokens [num_computed_tokens, num_computed_tokens + num_new_tokens) of its
    context; the page table and token ids are read from its Request."""

    request: Request
    num_computed_tokens: int  # tokens already in the cache before this step
    num_new_tokens: int  # tokens computed this step
    samples_token: bool  # the chunk reaches the end of the context: the step samples one new token for it
    # Speculation: draft tokens computed after the context's last token (counted in num_new_tokens). The step
    # verifies them and returns the accepted ones followed by one sampled token
    # (cbjax/runner/speculation/verification.py).
    draft_token_ids: list[int] | tuple = ()
    # Multi-step decoding (cbjax/core/multi_step.py): this decode runs this many of the block's steps, one token each.
    num_steps: int = 1


@dataclasses.dataclass(slots=True)
class SchedulerOutput:
    """One step's plan."""

    seqs: list[ScheduledSeq]
    num_batched_tokens: int
    preempted: list[Request]
    time: float
    # KV pages to copy before the step runs, swap-outs first: (device page, host page) and (host page, device page).
    swap_out: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    swap_in: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    # Copy-on-write of shared pages (core/sequence_group.py): (source page, destination page) device copies, run
    # after the swaps and before the step's program.
    page_copies: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    # > 1: a block of decode steps run in one dispatch (cbjax/core/multi_step.py); the runner returns a row of
    # tokens per step, and the first step is what `seqs` and `num_batched_tokens` describe.
    num_steps: int = 1
    # A block's rows computed for nothing, the price of blocks: those of slots idle past their last step (set when
    # it is planned) and those of sequences that stopped inside it on EOS or a stop token (added at update).
    num_wasted_tokens: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.seqs

    @property
    def num_draft_tokens(self) -> int:
        return sum(len(s.draft_token_ids) for s in self.seqs)
