"""How many draft tokens a step verifies per sequence: pluggable rules, each `num_drafts(batch_size) -> k`.

Speculation pays when the device has idle compute (small batches: a step of B*(1+k) tokens costs about what a
step of B tokens does) and hurts when it does not (large batches: every rejected draft is paid-for work). The rules:

  FixedDraftLength(k)            always k (vLLM's behaviour).
  BatchSizeDraftLength(table)    k by the number of running sequences, e.g. {"1-8": 4, "9-32": 2, "33-": 0}.
  MeasuredDraftLength(k_max)     the k that maximises expected accepted tokens per second, from the acceptance by
                                 position and the step times measured during the run (`observe_step`).
"""

import math
from collections.abc import Sequence


class DraftLengthRule:
    """The interface: `num_drafts(batch_size)` for the coming step; `observe_step` and `observe_acceptance` feed
    measurements (rules that do not learn ignore them)."""

    max_drafts: int = 0

    def num_drafts(self, batch_size: int) -> int:
        raise NotImplementedError

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        pass

    def observe_acceptance(self, drafted_by_position: Sequence[int], accepted_by_position: Sequence[int]) -> None:
        pass


class FixedDraftLength(DraftLengthRule):
    def __init__(self, k: int):
        self.max_drafts = k

    def num_drafts(self, batch_size: int) -> int:
        return self.max_drafts


class BatchSizeDraftLength(DraftLengthRule):
    """table: ((first batch size, last or None, k), ...) as SpeculativeConfig parses it."""

    def __init__(self, table: Sequence[tuple[int, int | None, int]]):
        self.table = tuple(table)
        self.max_drafts = max(k for _, _, k in self.table)

    def num_drafts(self, batch_size: int) -> int:
        for lo, hi, k in self.table:
            if batch_size >= lo and (hi is None or batch_size <= hi):
                return k
        return 0


class MeasuredDraftLength(DraftLengthRule):
    """Expected accepted tokens per second for k drafts and B sequences: B * E[k] / t(B * (1 + k)), where
    E[k] = 1 + sum_{j<=k} prod_{i<=j} a_i from the measured acceptance rate a_i of draft position i, and t(n) a
    straight line fitted (exponentially weighted least squares) to the measured wall time of steps of n tokens.

    Until it has measured enough it explores: k_max while no acceptance is known, and a prior slope for the step
    time (a step's cost grows with its tokens) until two distinct step sizes were seen. Decay keeps it following
    the run (a changing mix of prompts changes the acceptance)."""

    def __init__(self, k_max: int, decay: float = 0.98, prior_acceptance: float = 0.5):
        self.max_drafts = k_max
        self.decay = decay
        self._drafted = [1.0] * k_max  # weighted counts, a prior of one draft at prior_acceptance per position
        self._accepted = [prior_acceptance] * k_max
        self._sums = [0.0] * 5  # weighted n, sum x, sum y, sum xx, sum xy of (tokens, seconds)

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        s, d = self._sums, self.decay
        x, y = float(num_tokens), float(seconds)
        for i, v in enumerate((1.0, x, y, x * x, x * y)):
            s[i] = s[i] * d + v

    def observe_acceptance(self, drafted_by_position, accepted_by_position) -> None:
        d = self.decay
        for i, (n, a) in enumerate(zip(drafted_by_position, accepted_by_position)):
            if n:
                self._drafted[i] = self._drafted[i] * d + n
                self._accepted[i] = self._accepted[i] * d + a

    def acceptance_rates(self) -> list[float]:
        return [a / n for a, n in zip(self._accepted, self._drafted)]

    def step_time(self, num_tokens: int) -> float:
        n, sx, sy, sxx, sxy = self._sums
        if n < 1e-9:
            return 1.0 + num_tokens / 64  # nothing measured: any increasing cost
        mean_x, mean_y = sx / n, sy / n
        var = sxx / n - mean_x * mean_x
        slope = (sxy / n - mean_x * mean_y) / var if var > 1e-6 else mean_y / max(mean_x, 1.0) / 4
        slope = max(slope, 0.0)
        return max(mean_y + slope * (num_tokens - mean_x), 1e-6)

    def num_drafts(self, batch_size: int) -> int:
        B = max(batch_size, 1)
        best_k, best_rate, expected, survive = 0, -math.inf, 1.0, 1.0
        rates = self.acceptance_rates()
        for k in range(self.max_drafts + 1):
            if k:
                survive *= rates[k - 1]
                expected += survive
            rate = B * expected / self.step_time(B * (1 + k))
            if rate > best_rate * 1.02:  # a clear gain only: fewer drafts on a tie (less wasted work)
                best_k, best_rate = k, rate
        return best_k


def make_draft_length_rule(config) -> DraftLengthRule:
    """The rule a SpeculativeConfig names."""
    k = config.num_speculative_tokens
    if config.draft_length == "fixed":
        return FixedDraftLength(k)
    if config.draft_length == "batch_size":
        return BatchSizeDraftLength(config.draft_length_table)
    if config.draft_length == "measured":
        return MeasuredDraftLength(k)
    raise ValueError(f"unknown draft_length rule {config.draft_length!r}")
