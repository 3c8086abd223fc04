"""What a cost model sees of one step: the numbers of a SchedulerOutput that its run time depends on."""

import dataclasses

from cbjax.core.scheduler_output import SchedulerOutput

FEATURE_NAMES = (
    "padded_tokens",
    "num_tokens",
    "decode_tokens",
    "prefill_tokens",
    "num_seqs",
    "num_sampling_seqs",
    "sum_context",
    "max_context",
    "attention_pairs",
    "swap_bytes",
    "copy_bytes",
)


@dataclasses.dataclass(frozen=True, slots=True)
class StepFeatures:
    """One step, as numbers. A decode is a sequence computing one token; any longer chunk is prefill (a prompt
    chunk or a recompute). `sum_context` / `max_context` are over the context lengths after the step (what the
    attention reads); `attention_pairs` is the number of (query, key) pairs the attention computes, sum over
    sequences of new_tokens * (computed + (new_tokens + 1) / 2). `swap_bytes` is the KV copied out plus in;
    `copy_bytes` the KV pages copied within the device before the step (copy-on-write, core/sequence_group.py)."""

    padded_tokens: int = 0  # the token bucket the step is padded to (0: a swap-only step)
    num_tokens: int = 0
    decode_tokens: int = 0
    prefill_tokens: int = 0
    num_seqs: int = 0
    num_sampling_seqs: int = 0
    sum_context: int = 0
    max_context: int = 0
    attention_pairs: float = 0.0
    swap_bytes: int = 0
    copy_bytes: int = 0

    def as_dict(self) -> dict:
        return {name: getattr(self, name) for name in FEATURE_NAMES}


def step_features(out: SchedulerOutput, padded_tokens: int, bytes_per_page: int) -> StepFeatures:
    """The features of step `out`, padded to `padded_tokens`, whose KV pages are `bytes_per_page` each."""
    decode = prefill = sum_ctx = max_ctx = sampling = 0
    pairs = 0.0
    for s in out.seqs:  # once per sequence and step: no calls in the loop
        n, c = s.num_new_tokens, s.num_computed_tokens
        if n == 1:
            decode += 1
            pairs += c + 1.0  # n * (c + (n + 1) / 2), exactly, for n = 1
        else:
            prefill += n
            pairs += n * (c + (n + 1) / 2)
        ctx = c + n
        sum_ctx += ctx
        if ctx > max_ctx:
            max_ctx = ctx
        if s.samples_token:
            sampling += 1
    return StepFeatures(  # positionally, in the fields' order (keywords cost ~0.5 us more per step)
        padded_tokens,
        decode + prefill,
        decode,
        prefill,
        len(out.seqs),
        sampling,
        sum_ctx,
        max_ctx,
        pairs,
        (len(out.swap_out) + len(out.swap_in)) * bytes_per_page,
        len(out.page_copies) * bytes_per_page,
    )
