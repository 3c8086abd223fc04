"""What speculative decoding can gain, from the acceptance rate and the cost of a verifying step: the standard
model (Leviathan, Kalman and Matias 2023, "Fast Inference from Transformers via Speculative Decoding") and its
prediction on a named accelerator from the roofline (roofline.py). A prediction, never a measurement.

With k drafts per step, each accepted with probability alpha independently of the others (the model's
simplification), a verifying step yields E = (1 - alpha^(k+1)) / (1 - alpha) tokens: the accepted drafts and one
token of the target's. If the step costs (1 + k c + o) plain decode steps (c: a draft forward over a target
forward; o: what the verification adds besides the draft forwards), the speedup over plain decoding is
E / (1 + k c + o).

On an accelerator at batch 1 a decode step is bound by reading the weights: verifying k + 1 tokens costs about
what one token does, and a draft iteration about the draft's bytes over the target's. `SpeculationRoofline` says
what a verifying step of this engine would cost there: the target's forward over the k + 1 tokens, k + 1 draft
forwards (the proposal loop also writes the last draft's K/V, cbjax/runner/speculation/draft_proposals.py), each
with a fixed `iteration_overhead_s`, and the step's `step_overhead_s`; a plain step's overhead is shared by the
`block_steps` decode steps of a dispatch (the offline default runs blocks of 8), a verifying step pays it alone.
"""

import dataclasses

from cbjax.sim.features import StepFeatures
from cbjax.sim.roofline import RooflineCost, model_shape


def _check(alpha: float, k: int) -> None:
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha is a probability in [0, 1], got {alpha}")
    if not isinstance(k, int) or k < 0:
        raise ValueError(f"k is a number of drafts >= 0, got {k!r}")


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens a verifying step yields on average: 1 + alpha + ... + alpha^k."""
    _check(alpha, k)
    return float(k + 1) if alpha == 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def alpha_for_tokens(tokens: float, k: int) -> float:
    """The alpha whose expected_tokens(alpha, k) is `tokens` (in [1, k + 1]): the per-draft acceptance the model
    needs to explain a measured mean acceptance length."""
    _check(0.0, k)
    if not 1.0 <= tokens <= k + 1:
        raise ValueError(f"a step with {k} drafts yields between 1 and {k + 1} tokens, got {tokens}")
    lo, hi = 0.0, 1.0
    for _ in range(60):  # expected_tokens rises with alpha: bisection
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_tokens(mid, k) < tokens else (lo, mid)
    return (lo + hi) / 2


def speedup(alpha: float, k: int, step_cost: float) -> float:
    """Tokens per unit time over plain decoding's: E / step_cost, the verifying step's cost in plain steps."""
    if step_cost <= 0:
        raise ValueError(f"step_cost is a positive number of plain steps, got {step_cost}")
    return expected_tokens(alpha, k) / step_cost


def _one_sequence(tokens: int, context: int) -> StepFeatures:
    """One sequence computing `tokens` tokens after `context` computed ones, every row through the LM head."""
    return StepFeatures(
        padded_tokens=tokens,
        num_tokens=tokens,
        decode_tokens=tokens if tokens == 1 else 0,
        prefill_tokens=0 if tokens == 1 else tokens,
        num_seqs=1,
        num_sampling_seqs=tokens,
        sum_context=context + tokens,
        max_context=context + tokens,
        attention_pairs=tokens * (context + (tokens + 1) / 2),
    )


@dataclasses.dataclass(frozen=True)
class SpeculationRoofline:
    """Batch-1 speculation with a draft model on a named accelerator (roofline.ACCELERATORS), from the two models'
    shapes (roofline.model_shape): times in seconds."""

    target_shape: dict
    draft_shape: dict
    accelerator: str
    step_overhead_s: float = 0.0  # per dispatch (launch, host work not hidden)
    iteration_overhead_s: float = 0.0  # per draft iteration inside the step's program
    block_steps: int = 8  # decode steps per plain dispatch (the offline LLM's num_scheduler_steps)

    def __post_init__(self):
        if self.step_overhead_s < 0 or self.iteration_overhead_s < 0 or self.block_steps < 1:
            raise ValueError("overheads must be >= 0 and block_steps >= 1")

    @classmethod
    def for_models(cls, target_cfg, draft_cfg, accelerator: str, **options) -> "SpeculationRoofline":
        return cls(model_shape(target_cfg), model_shape(draft_cfg), accelerator, **options)

    def _cost(self, shape: dict) -> RooflineCost:
        return RooflineCost(shape, self.accelerator, overhead_s=0.0)

    def plain_token_s(self, context: int) -> float:
        """A plain decode step's time per token, its dispatch overhead shared by the block's steps."""
        return self._cost(self.target_shape).step_time(_one_sequence(1, context)) + (
            self.step_overhead_s / self.block_steps
        )

    def draft_iteration_s(self, context: int) -> float:
        return self._cost(self.draft_shape).step_time(_one_sequence(1, context)) + self.iteration_overhead_s

    def verify_step_s(self, k: int, context: int) -> float:
        """The target over k + 1 tokens, k + 1 draft iterations and the step's overhead."""
        _check(0.0, k)
        target = self._cost(self.target_shape).step_time(_one_sequence(k + 1, context))
        return target + (k + 1) * self.draft_iteration_s(context) + self.step_overhead_s

    def cost_ratio(self, context: int) -> float:
        """c: a draft iteration over a plain target step (overheads included)."""
        return self.draft_iteration_s(context) / self.plain_token_s(context)

    def speedup(self, alpha: float, k: int, context: int) -> float:
        """Tokens per second with k drafts over plain decoding's, at one sequence of `context` tokens."""
        return expected_tokens(alpha, k) * self.plain_token_s(context) / self.verify_step_s(k, context)
