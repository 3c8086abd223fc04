"""Beam search the way vLLM's `LLM.beam_search` runs it, on the same engine as everything else.

Each round, every live beam of every prompt is one request for one token with `logprobs=2 * beam_width`: its
candidates are the returned tokens (the top 2W of the model's log-softmax, and the sampled token when it is not
among them), each scored by the beam's cumulative log-probability plus its own. A candidate ending in EOS is a
finished beam (unless `ignore_eos`); the best `beam_width` unfinished candidates of a prompt are its next beams.
After `max_tokens` rounds the live beams join the finished ones and the best `beam_width` by
`cum_logprob / len(tokens) ** length_penalty` (tokens: the prompt and the output, less a final EOS; vLLM's
`get_beam_search_score`) come back, best first.

The beams of a prompt share their KV pages through the prefix cache, as in vLLM v1: with `enable_prefix_caching`
each round's requests find the full pages of their common prefix already computed and only the last, partly
filled page is recomputed. Beams that die simply do not come back; their pages return to the cache's LRU. (The
sequence groups of n > 1, core/sequence_group.py, fork pages with copy-on-write instead; beams are not run as a
group because their number of children per round is not known until the round's logprobs arrive.)
"""

from collections.abc import Sequence
from dataclasses import dataclass, field

from cbjax.config import validation as check
from cbjax.core.sampling_params import SamplingParams


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's BeamSearchParams: `beam_width` beams, up to `max_tokens` output tokens each; `temperature` is that of
    the one-token requests (0: the sampled token is always among the top candidates); `length_penalty` the exponent
    of the length in the final score."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0

    def __post_init__(self):
        object.__setattr__(self, "beam_width", check.integer("beam_width", self.beam_width, 1))
        object.__setattr__(self, "max_tokens", check.integer("max_tokens", self.max_tokens, 1))
        object.__setattr__(self, "ignore_eos", check.boolean("ignore_eos", self.ignore_eos))
        object.__setattr__(self, "temperature", check.real("temperature", self.temperature, 0.0))
        object.__setattr__(self, "length_penalty", check.real("length_penalty", self.length_penalty))


@dataclass
class BeamSearchSequence:
    """One beam: `tokens` holds the prompt and the output (`output_token_ids` the output alone)."""

    tokens: list[int]
    num_prompt_tokens: int
    cum_logprob: float = 0.0
    logprobs: list[float] = field(default_factory=list)  # of each output token
    finished: bool = False
    text: str | None = None

    @property
    def output_token_ids(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens :]


@dataclass
class BeamSearchOutput:
    """A prompt's best beams, best first."""

    sequences: list[BeamSearchSequence]


def beam_search_score(beam: BeamSearchSequence, eos_token_id: int | None, length_penalty: float) -> float:
    """vLLM's get_beam_search_score: the cumulative log-probability over the length (prompt and output, less a
    final EOS) to the power length_penalty."""
    length = len(beam.tokens) - (1 if beam.tokens[-1] == eos_token_id else 0)
    return beam.cum_logprob / (length**length_penalty)


def beam_search(llm, prompts: Sequence, params: BeamSearchParams) -> list[BeamSearchOutput]:
    """Run beam search for each prompt (token ids, or text with a tokenizer) on `llm` (a cbjax.LLM); see the
    module docstring. ValueError for a prompt the engine refuses (the whole call: a beam cannot be half run)."""
    if not isinstance(params, BeamSearchParams):
        raise ValueError(f"params must be BeamSearchParams, got {type(params).__name__}")
    engine = llm.engine
    tokenizer, eos = engine.tokenizer, engine.model_config.eos_token_id
    width = params.beam_width
    one_token = SamplingParams(
        max_tokens=1, temperature=params.temperature, logprobs=2 * width, ignore_eos=params.ignore_eos
    )
    live: list[list[BeamSearchSequence]] = []
    for prompt in prompts:
        ids = tokenizer.encode(prompt) if isinstance(prompt, str) and tokenizer is not None else prompt
        ids = check.token_ids("prompt", ids, engine.model_config.vocab_size)
        live.append([BeamSearchSequence(list(ids), len(ids))])
    done: list[list[BeamSearchSequence]] = [[] for _ in live]
    rank = lambda b: beam_search_score(b, eos, params.length_penalty)
    for _ in range(params.max_tokens):
        beams = [b for group in live for b in group]
        if not beams:
            break
        outputs = llm.generate([b.tokens for b in beams], one_token)
        for out in outputs:
            if out.error is not None:
                raise ValueError(f"beam search: the engine refused a beam: {out.error}")
        results = iter(outputs)
        for i, group in enumerate(live):
            candidates = []
            for beam in group:
                completion = next(results).outputs[0]
                for token, lp in completion.logprobs[0].items():
                    child = BeamSearchSequence(
                        beam.tokens + [token],
                        beam.num_prompt_tokens,
                        beam.cum_logprob + lp.logprob,
                        beam.logprobs + [lp.logprob],
                    )
                    if token == eos and not params.ignore_eos:
                        child.finished = True
                        done[i].append(child)
                    else:
                        candidates.append(child)
            # (Stable sort: among equal scores the earlier beam's, then the more likely token's, candidate first.)
            live[i] = sorted(candidates, key=rank, reverse=True)[:width]
    results = []
    for group, finished in zip(live, done):
        best = sorted(finished + group, key=rank, reverse=True)[:width]
        if tokenizer is not None:
            for b in best:
                b.text = tokenizer.decode(b.output_token_ids)
        results.append(BeamSearchOutput(best))
    return results
