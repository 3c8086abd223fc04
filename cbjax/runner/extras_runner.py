"""SamplingExtras: the host side of the sampling extras (the device side: sampling_extras.py).

After each plain step the ModelRunner hands it the step; when no scheduled request asks for extras it returns at
once (one pass over the step's requests reading a flag). Otherwise it packs the extras rows of the step's S slots
(the request's sampling parameters, its penalty row, its sparse biases and its bitmask, all computed here on the
host), dispatches the extras sampler of S behind the step, and keeps the logprob outputs on the step's handle; the
runner's fetch hands them back here (`receive`), which appends them to the requests (Request.logprobs).

What is computed on the host, at pack time, for a row:
- its bans: the EOS and stop ids before `min_tokens` outputs; each single-token bad word; a longer bad word's last
  token when the output ends with the rest of it (vLLM's rule); the -inf entries a logits processor returns; a
  structured-output constraint's bitmask (`fill_bitmask`). All clear bits of the row's bitmask.
- its finite biases: `logit_bias` and a logits processor's finite entries, as at most MAX_SPARSE_BIASES sparse
  (id, bias) pairs (a `logit_bias` with more is refused at add_request). A logits processor that raises, or
  returns a bad id, a bad bias or too many finite biases, fails its request: Request.error is set here and the
  engine aborts the request when the step's tokens arrive; the step and the other requests go on.
Bad words of several tokens, processors and constraints read the request's previous outputs: the engine receives a
step holding such a request before it schedules the next (in LLMEngine.step), so they are known on the host.

Penalties count each request's output tokens in a device table [R, V] (R = max_num_seqs + 1; the last row stays
zeros for rows without penalties), next to a table of its prompt's tokens: a request gets a row the first time it
is scheduled (initialised from its prompt and outputs), keeps it across preemption, and loses it when it finishes,
or when every row is taken by others (it is then initialised again from its history when it next runs). The
extras sampler adds each sampled token to its row on the device, so the next step, dispatched before the token
reaches the host, sees it.

prompt_logprobs: a request asking for them has its prompt scored once, when its first chunk is dispatched, by the
prompt scorer (sampling_extras.prompt_scorer: a full-sequence forward over the prompt padded to a length bucket),
whatever chunking, prefix-cache hits or preemption do to its prefill afterwards. It costs a second forward over
the prompt for those requests only, and its attention is the plain [L, L] one (memory grows with the prompt's
square): fine for scoring, not meant for prompts of tens of thousands of tokens.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from cbjax.core.outputs import Logprob
from cbjax.core.request import Request
from cbjax.core.sampling_params import logit_bias_dict
from cbjax.runner.sampling_extras import ExtrasRows, extras_sampler, prompt_scorer, set_penalty_row
from cbjax.runner.step_input import token_buckets

# Sparse finite biases per row (logit_bias and processors' finite entries together). A static shape of the
# extras sampler; bans (-inf) go through the bitmask, which has no cap.
MAX_SPARSE_BIASES = 128


def has_penalties(p) -> bool:
    return bool(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0)


@dataclasses.dataclass
class ExtrasHandle:
    """What a step's extras left on the device for `receive`: the logprob outputs of its rows and the prompt
    scorers it dispatched."""

    logprob_rows: list[tuple[int, Request, int]]  # (slot, request, k) of the rows that report logprobs
    logprobs: tuple | None  # the extras sampler's logprob_summary, on the device
    prompts: list[tuple[Request, int, tuple]]  # (request, k, prompt_scorer's outputs on the device)


class SamplingExtras:
    """The sampling extras of one ModelRunner (its penalty tables, the rows they hold, the compiled programs)."""

    def __init__(self, cfg, buckets, placement, compiles, graphdef, *, max_logprobs: int, precompile: bool):
        """cfg: the model's config; `max_logprobs`: the most logprobs / prompt_logprobs a request may ask for (a
        static shape); `precompile`: build every extras program at warmup (else each when first needed: a compile)."""
        self.cfg, self.buckets, self.compiles, self.graphdef = cfg, buckets, compiles, graphdef
        self.placement, self.precompile = placement, precompile
        self.num_logprobs = max(1, max_logprobs)
        V = self.vocab_size = cfg.vocab_size
        self.mask_words = -(-V // 32)
        self.num_rows = R = buckets.max_num_seqs + 1
        # The penalty tables, [R, V] each (41 MB at R = 257, V = 32k): allocated when the first extras row is
        # sampled or a row initialised (`_tables`), so an engine whose requests never ask for extras holds none.
        self.counts = self.prompt_seen = None
        self.row_of: dict[Request, int] = {}
        self.free_rows = list(range(R - 1))
        self.prompt_lengths = token_buckets(16, buckets.pages_per_seq * buckets.page_size)
        self.scoring: set[Request] = set()  # requests whose prompt scorer is dispatched, not yet received
        self.num_extras_steps = 0  # steps that ran the extras sampler (for tests)

    # ---- warmup -----------------------------------------------------------------------------------------------
    def warmup(self, params) -> None:
        """Build (and run once, on padding) every extras program: the sampler of each slot count, the row
        initialiser and the prompt scorer of each length bucket. A no-op unless `precompile`."""
        if not self.precompile:
            return
        b = self.buckets
        plain = self.placement.put(jnp.zeros(b.max_num_seqs, jnp.int32))
        for S in sorted({b.slots(T) for T in b.token_buckets}):
            hidden = self.placement.put(jnp.zeros((S, self.cfg.hidden_size), jnp.dtype(self.cfg.dtype)))
            rows = self._empty_rows(S)
            jax.block_until_ready(self._sample(params, hidden, plain, rows))
        dummy = self.num_rows - 1  # stays zeros
        self._set_row(dummy, np.zeros(self.vocab_size, np.int32), np.zeros(self.vocab_size, bool))
        for L in self.prompt_lengths:
            jax.block_until_ready(self._score(params, np.zeros((1, L), np.int32)))

    # ---- one step ---------------------------------------------------------------------------------------------
    def after_step(self, params, out, order, inp, sample_hidden, tokens):
        """After a plain step's dispatch: the prompt scorers it needs and, if any of its rows has extras, the
        extras sampler. Returns (tokens, ExtrasHandle or None): the step's tokens, merged with the extras rows'."""
        seqs = out.seqs
        if not any(s.request.needs_extras for s in seqs):
            return tokens, None
        prompts = []
        for s in seqs:
            r = s.request
            k = r.params.prompt_logprobs
            if k is not None and r.prompt_logprobs is None and r not in self.scoring:
                self.scoring.add(r)  # (scored once, at its first step, whatever its first chunk; `receive` stores it)
                prompts.append((r, k, self._score(params, self._padded_prompt(r))))
        slots = [i for i, j in enumerate(order) if seqs[j].samples_token and seqs[j].request.samples_with_extras]
        if not slots:
            return tokens, ExtrasHandle([], None, prompts)
        rows, logprob_rows = self._pack(seqs, order, slots, inp)
        tokens, logprobs = self._sample(params, sample_hidden, tokens, rows)
        self.num_extras_steps += 1
        return tokens, ExtrasHandle(logprob_rows, logprobs if logprob_rows else None, prompts)

    def receive(self, handle: ExtrasHandle, host_tokens: np.ndarray) -> None:
        """A step's extras reached the host: each logprob row's entry appended to its request (unless the request
        finished meanwhile: then its token is dropped too), each prompt's scores stored."""
        if handle.logprobs is not None:
            chosen, rank, top_ids, top_lp = (np.asarray(a) for a in handle.logprobs)
            for i, r, k in handle.logprob_rows:
                if r.is_finished:
                    continue
                entry = _entry(int(host_tokens[i]), chosen[i], rank[i], top_ids[i, :k], top_lp[i, :k])
                r.logprobs.append(entry)
                r.cumulative_logprob += float(chosen[i])
        for r, k, scored in handle.prompts:
            chosen, rank, top_ids, top_lp = (np.asarray(a) for a in scored)
            self.scoring.discard(r)
            prompt = r.prompt_token_ids
            r.prompt_logprobs = [None] + [
                _entry(prompt[i + 1], chosen[i], rank[i], top_ids[i, :k], top_lp[i, :k]) for i in range(len(prompt) - 1)
            ]

    # ---- packing ----------------------------------------------------------------------------------------------
    def _pack(self, seqs, order, slots, inp):
        S = inp.layout.S
        step = inp.unflatten()
        rows = self._empty_rows(S, host=True)
        for name in ("temperature", "top_k", "top_p", "seeds", "counters"):
            getattr(rows, name)[:] = getattr(step, name)
        allowed = rows.allowed.view(np.uint32)
        logprob_rows = []
        for i in slots:
            r = seqs[order[i]].request
            p = r.params
            rows.active[i] = 1
            index = int(step.counters[i])  # of the output this row samples
            previous = r.output_token_ids[:index]
            if p.logprobs is not None:
                logprob_rows.append((i, r, p.logprobs))
                rows.wants_logprobs[i] = 1
            if has_penalties(p):
                rows.penalty_row[i] = self._row(r, previous, {seqs[j].request for j in order})
                rows.presence[i], rows.frequency[i], rows.repetition[i] = (
                    p.presence_penalty,
                    p.frequency_penalty,
                    p.repetition_penalty,
                )
            if r.constraint is not None:
                r.constraint.fill_bitmask(rows.allowed[i])
            biases, bans = logit_bias_dict(p), self._bans(r, previous)
            try:
                for f in p.logits_processors:
                    for token, bias in _processor_biases(f, previous, self.vocab_size):
                        if bias == -math.inf:
                            bans.append(token)
                        else:
                            biases[token] = biases.get(token, 0.0) + bias
                if len(biases) > MAX_SPARSE_BIASES:
                    raise ValueError(
                        f"{len(biases)} finite logit biases in one step (logit_bias and logits processors "
                        f"together), more than {MAX_SPARSE_BIASES}; return -inf to ban a token"
                    )
            except Exception as e:  # (a processor is user code) the request fails, the step goes on
                r.error = f"logits processor failed: {type(e).__name__}: {e}"
                biases = logit_bias_dict(p)  # its token this step is dropped: the engine aborts it on receipt
            for token in bans:
                allowed[i, token >> 5] &= ~np.uint32(1 << (token & 31))
            if r.constraint is not None and not allowed[i].any():
                # The grammar allows only banned tokens (its end, EOS, before min_tokens): the grammar wins, since
                # the constraint would refuse anything else it could sample.
                r.constraint.fill_bitmask(rows.allowed[i])
            if biases:
                rows.bias_ids[i, : len(biases)] = list(biases)
                rows.bias_values[i, : len(biases)] = list(biases.values())
        return rows, logprob_rows

    def _bans(self, r: Request, previous: list[int]) -> list[int]:
        """The tokens row `r` may not sample now: EOS and stop ids before min_tokens, and the bad words' (vLLM's
        rule: a single token always; a longer word's last token when the output ends with the rest of it)."""
        p, bans = r.params, []
        if len(previous) < p.min_tokens:
            bans += p.stop_token_ids
            if not p.ignore_eos and self.cfg.eos_token_id is not None:
                bans.append(self.cfg.eos_token_id)
        for word in r.bad_word_ids:
            n = len(word) - 1
            if n == 0 or (len(previous) >= n and tuple(previous[len(previous) - n :]) == tuple(word[:-1])):
                bans.append(word[-1])
        return bans

    def _row(self, r: Request, previous: list[int], in_step: set) -> int:
        """The penalty row of `r`, given one (initialised from its history) if it has none."""
        row = self.row_of.get(r)
        if row is not None:
            return row
        for held in [q for q in self.row_of if q.is_finished]:
            self.free_rows.append(self.row_of.pop(held))
        if not self.free_rows:  # every row held by a live request: take one from a request not in this step
            victim = next(q for q in self.row_of if q not in in_step)
            self.free_rows.append(self.row_of.pop(victim))
        row = self.row_of[r] = self.free_rows.pop()
        V = self.vocab_size
        seen = np.zeros(V, bool)
        seen[r.prompt_token_ids] = True
        # (Its outputs are all on the host here: a request without a row was not in the step still in flight.)
        known = np.asarray([t for t in previous if t >= 0], np.int64)
        self._set_row(row, np.bincount(known, minlength=V).astype(np.int32), seen)
        return row

    def _empty_rows(self, S: int, host: bool = False) -> ExtrasRows:
        E, W = MAX_SPARSE_BIASES, self.mask_words
        dummy = self.num_rows - 1
        rows = ExtrasRows(
            active=np.zeros(S, np.int32),
            wants_logprobs=np.zeros(S, np.int32),
            temperature=np.zeros(S, np.float32),
            top_k=np.zeros(S, np.int32),
            top_p=np.ones(S, np.float32),
            seeds=np.zeros(S, np.uint32),
            counters=np.zeros(S, np.int32),
            penalty_row=np.full(S, dummy, np.int32),
            presence=np.zeros(S, np.float32),
            frequency=np.zeros(S, np.float32),
            repetition=np.ones(S, np.float32),
            bias_ids=np.zeros((S, E), np.int32),
            bias_values=np.zeros((S, E), np.float32),
            allowed=np.full((S, W), -1, np.int32),
        )
        return rows

    def _padded_prompt(self, r: Request) -> np.ndarray:
        n = r.num_prompt_tokens
        L = next(b for b in self.prompt_lengths if b >= n)
        tokens = np.zeros((1, L), np.int32)
        tokens[0, :n] = r.prompt_token_ids
        return tokens

    # ---- the programs (each call counts its compile, if any, for the runner) ----------------------------------
    def _tables(self) -> None:
        if self.counts is None:
            R, V, put = self.num_rows, self.vocab_size, self.placement.put
            self.counts, self.prompt_seen = put(jnp.zeros((R, V), jnp.int32)), put(jnp.zeros((R, V), bool))

    def _sample(self, params, hidden, plain, rows):
        self._tables()
        with self.compiles.counting():
            merged, logprobs, self.counts = extras_sampler(
                params,
                hidden,
                plain,
                rows,
                self.counts,
                self.prompt_seen,
                graphdef=self.graphdef,
                num_logprobs=self.num_logprobs,
            )
        return merged, logprobs

    def _set_row(self, row: int, counts: np.ndarray, seen: np.ndarray) -> None:
        self._tables()
        with self.compiles.counting():
            self.counts, self.prompt_seen = set_penalty_row(self.counts, self.prompt_seen, np.int32(row), counts, seen)

    def _score(self, params, tokens: np.ndarray):
        with self.compiles.counting():
            return prompt_scorer(params, tokens, graphdef=self.graphdef, num_logprobs=self.num_logprobs)


def _entry(token: int, chosen, rank, top_ids, top_lp) -> dict:
    """vLLM's per-token logprobs: the chosen token first, then the top k (rank 1 = the most likely)."""
    entry = {token: Logprob(float(chosen), int(rank))}
    for j, (t, lp) in enumerate(zip(top_ids.tolist(), top_lp.tolist())):
        entry.setdefault(t, Logprob(lp, j + 1))
    return entry


def _processor_biases(f, previous: list[int], V: int):
    """A logits processor's {token id: bias} for the output so far, checked (ValueError naming the problem)."""
    biases = f(list(previous))
    if not hasattr(biases, "items"):
        raise ValueError(f"a logits processor must return a dict of token id -> bias, got {biases!r}")
    for token, bias in biases.items():
        if not isinstance(token, (int, np.integer)) or not 0 <= token < V:
            raise ValueError(f"a logits processor returned token id {token!r} outside the vocabulary [0, {V})")
        bias = float(bias)
        if math.isnan(bias) or bias == math.inf:
            raise ValueError(f"a logits processor returned bias {bias!r} for token {token} (finite or -inf only)")
        yield int(token), bias


def check_request(params, *, compilation, vocab_size: int, speculative: bool, simulated: bool) -> None:
    """The limits of the sampling extras that depend on the engine (ValueError naming the problem): logprobs and
    prompt_logprobs up to compilation.max_logprobs; logit_bias ids in the vocabulary, at most MAX_SPARSE_BIASES;
    with speculative decoding, structured output only (`speculation_refuses`); the simulator (no logits)
    serves no logprobs and no structured output (its tokens are not a model's), and treats the other extras as
    free (they change which token, not the step's cost)."""
    for name in ("logprobs", "prompt_logprobs"):
        k = getattr(params, name)
        if k is not None and k > compilation.max_logprobs:
            raise ValueError(f"{name}={k} is more than this engine's max_logprobs={compilation.max_logprobs}")
        if k is not None and simulated:
            raise ValueError(f"{name} needs the model's logits; the simulator (runner='sim') has none")
    if params.structured is not None and simulated:
        raise ValueError("structured output needs the model's tokens; the simulator (runner='sim') makes up its own")
    bias = params.logit_bias or ()
    if len(bias) > MAX_SPARSE_BIASES:
        raise ValueError(f"logit_bias has {len(bias)} entries, more than {MAX_SPARSE_BIASES}")
    for token, _ in bias:
        if token >= vocab_size:
            raise ValueError(f"logit_bias token id {token} is outside the vocabulary [0, {vocab_size})")
    refused = speculation_refuses(params) if speculative else []
    if refused:
        raise ValueError(
            f"{', '.join(refused)} {'is' if len(refused) == 1 else 'are'} not supported with speculative decoding "
            "(speculative_config); of the sampling "
            "extras only structured output is"
        )


def speculation_refuses(params) -> list[str]:
    """The sampling extras a speculative engine refuses (all but structured output, whose mask is applied at every
    verify row: cbjax/runner/speculation/constrained_verify.py): verification samples drafts without them."""
    asked = {
        "logprobs": params.logprobs is not None,
        "presence_penalty": bool(params.presence_penalty),
        "frequency_penalty": bool(params.frequency_penalty),
        "repetition_penalty": params.repetition_penalty != 1.0,
        "min_tokens": bool(params.min_tokens),
        "bad_words": bool(params.bad_words),
        "logit_bias": bool(params.logit_bias),
        "logits_processors": bool(params.logits_processors),
    }
    return [name for name, on in asked.items() if on]
