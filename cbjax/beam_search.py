"""Beam search the way vLLM's `LLM.beam_search` runs it, on the same engine as everything else.

Each round, every live beam of every prompt is one request for one token with `logprobs=2 * beam_width`: its
candidates are the returned tokens (the top 2W of the model's log-softmax, and the sampled token when it is not
among them), each scored by the beam's cumulative log-probability plus its own. A candidate ending in EOS is a
finished beam (unless `ignore_eos`); the best `beam_width` unfinished candidates of a prompt are its next beams.
After `max_tokens` rounds the live beams join the finished ones and the best `beam_width` by
`cum_logprob / len(tokens) ** length_penalty` (tokens: the prompt and the output, less a final EOS; vLLM's
`get_beam_search_score`) come back, best first.

The beams share their KV pages by forking (core/kv_fork.py): each round's requests keep their pages when they
finish; a beam's children take references to them for the context they continue, and compute only their one new
token (the partly filled last page copied on write by the first child that writes into it while another holds it).
A beam that dies has no children: its pages go back to the pool when the round's parents are released. This needs
an LLMEngine (its scheduler keeps the pages); on another engine (data-parallel, disaggregated) each round's
requests compute their contexts, sharing only what the prefix cache holds, as vLLM v1 does. A child forks only into
a free slot: with more beams than `max_num_seqs` the others wait and compute their context.
"""

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field

from cbjax.config import validation as check
from cbjax.core.kv_fork import admit_forked
from cbjax.core.kv_handoff import KVHandoff
from cbjax.core.request import Request
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
    # The finished request whose kept pages hold this beam's context but its last token (None: the prompt).
    kv_source: Request | None = field(default=None, repr=False, compare=False)

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


def beam_search(llm, prompts: Sequence, params: BeamSearchParams, share_pages: bool = True) -> list[BeamSearchOutput]:
    """Run beam search for each prompt (token ids, or text with a tokenizer) on `llm` (a cbjax.LLM); see the
    module docstring. ValueError for a prompt the engine refuses (the whole call: a beam cannot be half run).
    `share_pages=False` turns the forking off (each round's beams compute their contexts: a baseline to measure
    the sharing against)."""
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
    rounds = _ForkedRounds(llm) if share_pages and _can_fork(engine) else None
    try:
        for _ in range(params.max_tokens):
            beams = [b for group in live for b in group]
            if not beams:
                break
            if rounds is not None:
                outputs = rounds.run(beams, one_token)
            else:
                outputs = llm.generate([b.tokens for b in beams], one_token)
                for out in outputs:
                    if out.error is not None:
                        raise ValueError(f"beam search: the engine refused a beam: {out.error}")
            results = iter(outputs)
            for i, group in enumerate(live):
                candidates = []
                for beam in group:
                    out = next(results)
                    completion = out.outputs[0]
                    for token, lp in completion.logprobs[0].items():
                        child = BeamSearchSequence(
                            beam.tokens + [token],
                            beam.num_prompt_tokens,
                            beam.cum_logprob + lp.logprob,
                            beam.logprobs + [lp.logprob],
                            kv_source=None if rounds is None else rounds.request_of[out.request_id],
                        )
                        if token == eos and not params.ignore_eos:
                            child.finished = True
                            done[i].append(child)
                        else:
                            candidates.append(child)
                # (Stable sort: among equal scores the earlier beam's, then the more likely token's, candidate first.)
                live[i] = sorted(candidates, key=rank, reverse=True)[:width]
    finally:
        if rounds is not None:
            rounds.close()
    results = []
    for group, finished in zip(live, done):
        best = sorted(finished + group, key=rank, reverse=True)[:width]
        if tokenizer is not None:
            for b in best:
                b.text = tokenizer.decode(b.output_token_ids)
        results.append(BeamSearchOutput(best))
    return results


def _can_fork(engine) -> bool:
    """Whether `engine` is an LLMEngine whose scheduler can keep pages for forks (not already keeping them for
    disaggregated serving)."""
    sched = getattr(engine, "scheduler", None)
    return sched is not None and hasattr(sched, "admit") and getattr(sched, "kv_handoff", "absent") is None


class _ForkedRounds:
    """Runs beam search's rounds on an LLMEngine with the beams' pages forked (see the module docstring): each
    round's requests keep their pages when they finish; the next round's children share them."""

    def __init__(self, llm):
        self.llm, self.engine = llm, llm.engine
        self.sched = self.engine.scheduler
        self.handoff = self.sched.kv_handoff = KVHandoff(self.sched.pool)
        self.request_of: dict[str, Request] = {}  # this round's requests by id
        self.kept: list[Request] = []  # finished requests whose pages are kept (the last round's)

    def run(self, beams: list[BeamSearchSequence], params: SamplingParams) -> list:
        engine, handoff = self.engine, self.handoff
        ids, self.request_of = [], {}
        try:
            for b in beams:
                rid = f"beam-{self.llm.num_submitted}"
                self.llm.num_submitted += 1
                engine.add_request(rid, b.tokens, params)
                req = engine.requests[rid]
                handoff.hold(req)
                if b.kv_source is not None:
                    admit_forked(self.sched, req, b.kv_source, handoff.pages(b.kv_source))
                ids.append(rid)
                self.request_of[rid] = req
        except ValueError as e:
            self._abort(ids)
            raise ValueError(f"beam search: the engine refused a beam: {e}") from None
        self._release()  # the children hold their references: the parents' pages (dead beams' too) can go
        results = {}
        try:
            while len(results) < len(ids):
                for out in engine.step():
                    if out.finished:
                        results[out.request_id] = out
        except BaseException:
            self._abort(ids)
            raise
        self.kept = list(self.request_of.values())
        return [results[rid] for rid in ids]

    def close(self) -> None:
        """Free the last round's kept pages and stop keeping pages."""
        self._release()
        self.sched.kv_handoff = None

    def _release(self) -> None:
        for req in self.kept:
            if req in self.handoff.held:
                self.handoff.release(req)
        self.kept = []

    def _abort(self, ids: list[str]) -> None:
        for rid in ids:
            req = self.engine.requests.get(rid)
            if req is not None and not req.is_finished:
                with contextlib.suppress(ValueError):
                    self.engine.abort_request(rid)
        self.kept += [r for r in self.request_of.values() if r in self.handoff.held]
        self.close()
