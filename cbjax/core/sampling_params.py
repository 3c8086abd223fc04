"""Sampling parameters, shaped like vLLM's (field names, defaults and meanings follow vllm.SamplingParams).

Plain sampling (greedy, temperature, top-k, top-p) runs inside the step program. The options a client asks for on
top of it (log-probabilities, penalties, min_tokens, bad words, logit bias, logits processors, structured output)
make a request one that `needs_sampling_extras`: the runner samples its rows with the extras on the device.
"""

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from cbjax.config import validation as check
from cbjax.core.structured_outputs import StructuredOutputs

# vLLM's ranges: presence and frequency penalties in [-2, 2]; a logit bias is clamped to [-100, 100].
PENALTY_RANGE = 2.0
LOGIT_BIAS_RANGE = 100.0


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request's output.

    temperature 0 means greedy. top_k -1 (or 0) means no top-k cut; top_p 1.0 means no nucleus cut. `seed` makes
    the request's samples reproducible whatever else shares its batch.

    `n` samples are returned per prompt, the best `n` of `best_of` (default n) by cumulative log-probability; the
    samples share the prompt's KV pages. `logprobs=k`: each output token's log-probability and the top k
    alternatives; `prompt_logprobs=k` the same for the prompt's tokens (both from the model's raw logits, before
    penalties and temperature: vLLM's default "raw_logprobs"). Penalties are vLLM's: presence and frequency
    subtract from the logits of tokens already in the output (once; per occurrence), repetition divides positive
    and multiplies negative logits of tokens in the prompt or the output. Before `min_tokens` outputs, EOS and the
    stop ids cannot be sampled. `bad_words`: strings whose token sequences are never completed. `logit_bias`:
    {token id: bias added to its logit}. `logits_processors`: callables `f(output_token_ids) -> {token id: bias}`
    called on the host before each token (a bias of -inf bans the token); the biases are added on the device.
    `stop`: strings that end the output (text models), not included unless `include_stop_str_in_output`.
    `structured`: a JSON schema, regex, choice or grammar the output must follow (StructuredOutputs).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    n: int = 1
    best_of: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    bad_words: tuple[str, ...] = field(default_factory=tuple)
    logit_bias: Mapping[int, float] | None = None
    logits_processors: tuple[Callable, ...] = field(default_factory=tuple)
    stop: tuple[str, ...] = field(default_factory=tuple)
    include_stop_str_in_output: bool = False
    structured: StructuredOutputs | None = None

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """Check every field's type and range (ValueError naming the field); store them as plain Python values.

        numpy integers and floats are accepted; bools are not numbers here, floats are not integers, NaN and
        infinities are refused. Lists (of stop ids, stop strings, bad words, processors) are stored as tuples and
        a logit bias as a sorted tuple of pairs, so the params stay hashable. Limits that depend on the engine (the
        vocabulary, max_logprobs) are checked when the request is added."""
        normal = dict(
            max_tokens=check.integer("max_tokens", self.max_tokens, 1),
            temperature=check.real("temperature", self.temperature, 0.0),
            top_p=check.real("top_p", self.top_p, 0.0, 1.0, low_open=True),
            top_k=check.integer("top_k (-1 or 0: off)", self.top_k, -1),
            seed=check.optional_integer("seed", self.seed, 0, 2**32 - 1),
            stop_token_ids=tuple(check.token_ids("stop_token_ids", self.stop_token_ids)),
            ignore_eos=check.boolean("ignore_eos", self.ignore_eos),
            n=check.integer("n", self.n, 1),
            logprobs=check.optional_integer("logprobs", self.logprobs, 0),
            prompt_logprobs=check.optional_integer("prompt_logprobs", self.prompt_logprobs, 0),
            presence_penalty=check.real("presence_penalty", self.presence_penalty, -PENALTY_RANGE, PENALTY_RANGE),
            frequency_penalty=check.real("frequency_penalty", self.frequency_penalty, -PENALTY_RANGE, PENALTY_RANGE),
            repetition_penalty=check.real("repetition_penalty", self.repetition_penalty, 0.0, low_open=True),
            bad_words=_strings("bad_words", self.bad_words),
            logit_bias=_logit_bias(self.logit_bias),
            logits_processors=_callables("logits_processors", self.logits_processors),
            stop=_strings("stop", self.stop),
            include_stop_str_in_output=check.boolean("include_stop_str_in_output", self.include_stop_str_in_output),
        )
        normal["best_of"] = check.optional_integer("best_of (>= n)", self.best_of, normal["n"])
        normal["min_tokens"] = check.integer("min_tokens (<= max_tokens)", self.min_tokens, 0, normal["max_tokens"])
        if self.structured is not None and not isinstance(self.structured, StructuredOutputs):
            raise ValueError(f"structured must be a StructuredOutputs or None, got {type(self.structured).__name__}")
        for name, value in normal.items():
            object.__setattr__(self, name, value)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def num_samples(self) -> int:
        """How many sequences the request runs: best_of (default n)."""
        return self.n if self.best_of is None else self.best_of

    @property
    def needs_sampling_extras(self) -> bool:
        """Whether the request's tokens need more than plain sampling: logprobs, penalties, min_tokens, bad words,
        a logit bias, logits processors or structured output (the runner samples its rows with the extras)."""
        return bool(
            self.logprobs is not None
            or self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.min_tokens
            or self.bad_words
            or self.logit_bias
            or self.logits_processors
            or self.structured is not None
        )


def _strings(name: str, value) -> tuple[str, ...]:
    """A string or a sequence of non-empty strings (vLLM's `stop` accepts either) -> a tuple."""
    if isinstance(value, str):
        value = (value,)
    if not isinstance(value, (list, tuple)) or not all(isinstance(s, str) and s for s in value):
        raise ValueError(f"{name} must be a string or a list of non-empty strings, got {value!r}")
    return tuple(value)


def _logit_bias(value) -> tuple[tuple[int, float], ...] | None:
    """{token id: bias} -> sorted (id, bias) pairs, each bias clamped to [-100, 100] as vLLM does."""
    if value is None:
        return None
    pairs = value.items() if isinstance(value, Mapping) else value
    try:
        pairs = list(pairs)
    except TypeError:
        raise ValueError(f"logit_bias must be a dict of token id -> bias, got {value!r}") from None
    out = {}
    for pair in pairs:
        if not isinstance(pair, tuple) or len(pair) != 2:
            raise ValueError(f"logit_bias must be a dict of token id -> bias, got {value!r}")
        token = check.integer("logit_bias token id", pair[0], 0)
        bias = check.real(f"logit_bias[{token}]", pair[1])
        out[token] = min(max(bias, -LOGIT_BIAS_RANGE), LOGIT_BIAS_RANGE)
    return tuple(sorted(out.items())) or None


def _callables(name: str, value) -> tuple[Callable, ...]:
    if callable(value):
        value = (value,)
    if not isinstance(value, (list, tuple)) or not all(callable(f) for f in value):
        raise ValueError(f"{name} must be a list of callables, got {value!r}")
    return tuple(value)


def logit_bias_dict(params: SamplingParams) -> dict[int, float]:
    """The request's logit bias as a dict (empty without one)."""
    return dict(params.logit_bias or ())
