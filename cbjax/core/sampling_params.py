"""Sampling parameters, shaped like vLLM's."""

from dataclasses import dataclass, field

from cbjax.config import validation as check


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
        self.validate()

    def validate(self) -> None:
        """Check every field's type and range (ValueError naming the field); store them as plain Python values.

        numpy integers and floats are accepted; bools are not numbers here, floats are not integers, NaN and
        infinities are refused. Lists of stop ids are stored as a tuple so the params stay hashable."""
        normal = dict(
            max_tokens=check.integer("max_tokens", self.max_tokens, 1),
            temperature=check.real("temperature", self.temperature, 0.0),
            top_p=check.real("top_p", self.top_p, 0.0, 1.0, low_open=True),
            top_k=check.integer("top_k (-1 or 0: off)", self.top_k, -1),
            seed=check.optional_integer("seed", self.seed, 0, 2**32 - 1),
            stop_token_ids=tuple(check.token_ids("stop_token_ids", self.stop_token_ids)),
            ignore_eos=check.boolean("ignore_eos", self.ignore_eos),
        )
        for name, value in normal.items():
            object.__setattr__(self, name, value)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
