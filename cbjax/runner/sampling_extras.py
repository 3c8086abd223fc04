"""The device side of the sampling extras: the programs that sample the rows asking for more than plain sampling
(logprobs, penalties, min_tokens, bad words, logit bias, logits processors, a structured-output mask), and the one
that scores a prompt (prompt_logprobs). The host side (which rows, their arrays, the penalty rows): extras_runner.py.

Why a program of its own: the plain step programs (step_program.py) stay what they were, and pay only one small
output, the final hidden state of each slot's last token ([S, D]). A step holding rows with extras is followed on
the device's queue, asynchronously, by the extras sampler of its slot count S: the LM head again on those rows
([S, V], the plain step's head is on the same rows, so this doubles only the head, not the forward), the sparse
biases and the bitmask, the penalties, then the same sampler as the plain step (sampler.py: the same per-request
keys, so a request with a zero penalty samples what it would have sampled plainly). Its tokens replace the plain
ones where a row has extras; the next step reads its pending tokens from the merged array.

Order of the changes to the logits, vLLM v1's (Sampler.forward): log-probabilities of the raw logits first
(`raw_logprobs`), then bans and biases (bad words, min_tokens, logit bias, logits processors), then the
penalties (repetition, then frequency and presence), then temperature, top-k and top-p.
"""

import functools
import typing

import jax
import jax.numpy as jnp
from flax import nnx

from cbjax.runner.sampler import sample


class ExtrasRows(typing.NamedTuple):
    """One step's extras arrays for its S slots (padding and plain rows: active 0, no biases, all allowed)."""

    active: jax.Array  # [S] int32: 1 where the slot's token comes from the extras sampler
    wants_logprobs: jax.Array  # [S] int32: 1 where the slot reports logprobs (none: the step skips them)
    temperature: jax.Array  # [S] f32
    top_k: jax.Array  # [S] i32
    top_p: jax.Array  # [S] f32
    seeds: jax.Array  # [S] u32
    counters: jax.Array  # [S] i32
    penalty_row: jax.Array  # [S] i32: the slot's row of the token-count tables (the last row: always zeros)
    presence: jax.Array  # [S] f32
    frequency: jax.Array  # [S] f32
    repetition: jax.Array  # [S] f32
    bias_ids: jax.Array  # [S, E] i32: sparse finite biases (padding: id 0, bias 0)
    bias_values: jax.Array  # [S, E] f32
    allowed: jax.Array  # [S, ceil(V / 32)] i32: bit j of word i allows token 32 i + j (bans clear bits)


def unpack_bitmask(words, V: int):
    """[S, W] int32 -> [S, V] bool (bit j of word i: token 32 i + j)."""
    bits = (words[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1
    return bits.reshape(words.shape[0], -1)[:, :V].astype(bool)


def apply_extras(logits, rows: ExtrasRows, counts, prompt_seen):
    """logits [S, V] f32 -> the logits each row samples from: bans and biases, then vLLM's penalties.

    counts [R, V] i32: each penalty row's output token counts; prompt_seen [R, V] bool: its prompt's tokens."""
    S = logits.shape[0]
    x = logits.at[jnp.arange(S)[:, None], rows.bias_ids].add(rows.bias_values)
    x = jnp.where(unpack_bitmask(rows.allowed, x.shape[1]), x, -jnp.inf)
    cnt = counts[rows.penalty_row]
    seen = prompt_seen[rows.penalty_row] | (cnt > 0)
    rp = rows.repetition[:, None]
    x = jnp.where(seen, jnp.where(x > 0, x / rp, x * rp), x)
    return x - rows.frequency[:, None] * cnt - rows.presence[:, None] * (cnt > 0)


def logprob_summary(raw, tokens, k: int):
    """raw [S, V] log-probabilities, tokens [S] -> (the tokens' logprobs [S], their ranks [S] (1: the most likely),
    the top k ids [S, k] and logprobs [S, k])."""
    chosen = jnp.take_along_axis(raw, tokens[:, None], axis=1)[:, 0]
    rank = 1 + jnp.sum(raw > chosen[:, None], axis=1, dtype=jnp.int32)
    top_lp, top_ids = jax.lax.top_k(raw, k)
    return chosen, rank, top_ids.astype(jnp.int32), top_lp


@functools.partial(jax.jit, static_argnames=("graphdef", "num_logprobs"), donate_argnames=("counts",))
def extras_sampler(
    params, sample_hidden, plain_tokens, rows: ExtrasRows, counts, prompt_seen, *, graphdef, num_logprobs
):
    """The extras sampler of one slot count S. sample_hidden [S, D] (the step's), plain_tokens [max_num_seqs] (the
    step's sampled tokens) -> (merged tokens [max_num_seqs], logprob outputs (logprob_summary of the raw logits),
    counts with each penalty row's new token counted). `counts` is donated: updated in place, in device order, so
    the next step (dispatched before this one's tokens reach the host) sees them."""
    module_def, treedef = graphdef.value
    model = nnx.merge(module_def, jax.tree.unflatten(treedef, params))
    logits = model.logits(sample_hidden)
    x = apply_extras(logits, rows, counts, prompt_seen)
    tokens = sample(x, rows.temperature, rows.top_k, rows.top_p, rows.seeds, rows.counters)
    S = tokens.shape[0]
    # (The log-softmax and the top k over V cost more than the rest on a CPU: only a step whose rows ask pays them.)
    summary = lambda: logprob_summary(jax.nn.log_softmax(logits, axis=-1), tokens, num_logprobs)
    skipped = lambda: (
        jnp.zeros(S, jnp.float32),
        jnp.zeros(S, jnp.int32),
        jnp.zeros((S, num_logprobs), jnp.int32),
        jnp.zeros((S, num_logprobs), jnp.float32),
    )
    logprobs = jax.lax.cond(jnp.any(rows.wants_logprobs > 0), summary, skipped)
    active = rows.active > 0
    merged = plain_tokens.at[:S].set(jnp.where(active, tokens, plain_tokens[:S]))
    dummy = counts.shape[0] - 1
    counted = active & (rows.penalty_row != dummy)
    counts = counts.at[rows.penalty_row, tokens].add(counted.astype(jnp.int32))
    return merged, logprobs, counts


@functools.partial(jax.jit, donate_argnames=("counts", "prompt_seen"))
def set_penalty_row(counts, prompt_seen, row, row_counts, row_prompt):
    """Initialise one row of the token-count tables (a request that gets a row: its outputs' counts [V] and its
    prompt's tokens [V] bool)."""
    return counts.at[row].set(row_counts), prompt_seen.at[row].set(row_prompt)


@functools.partial(jax.jit, static_argnames=("graphdef", "num_logprobs"))
def prompt_scorer(params, tokens, *, graphdef, num_logprobs):
    """tokens [1, L] (a prompt, padded after its end) -> logprob_summary of each prompt token after the first, from
    the full-sequence forward's log-softmax at the position before it: rows i = 0..L-2 score token i + 1."""
    module_def, treedef = graphdef.value
    model = nnx.merge(module_def, jax.tree.unflatten(treedef, params))
    raw = jax.nn.log_softmax(model.forward_full(tokens)[0, :-1], axis=-1)
    return logprob_summary(raw, tokens[0, 1:], num_logprobs)
