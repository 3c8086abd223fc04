"""Sampling parameters, shaped like vLLM's."""

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request's output.

    temperature 0 means greedy. top_k -1 (or 0) means no top-k cut; top_p 1.0 means no nucleus cut. `seed` makes
    the request's samples reproducible whatever else shares its batch.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False

    def __post_init__(self):
        # Lists are accepted for convenience; stored as a tuple so the params stay hashable.
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        self.validate()

    def validate(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off), 0 (off) or a positive integer, got {self.top_k!r}")
        if self.seed is not None and not 0 <= self.seed < 2**32:
            raise ValueError(f"seed must be in [0, 2**32), got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
