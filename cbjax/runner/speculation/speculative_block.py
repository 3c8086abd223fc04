"""A block of n-gram speculative decoding in one program: the device proposes drafts (prompt lookup over each
slot's token history, ngram_device.py), verifies them, keeps the accepted ones and the token after them, and does
it again, up to N times, without the host (issue 37: verify steps ran one per dispatch, synchronously, while the
default ran 8 decode steps per dispatch).

The block's input is its first step, packed as a decode step (slot s's one token is its last known token, at
position kv_lens[s] - 1; nothing pending), plus each slot's context history [S, L] (the tokens before and
including that last token, then anything) and its budget [S] (the most tokens the block may give it: its
max_tokens, max_model_len and N (K + 1) bound it, core/speculation/speculative_blocks.py; 0 for an empty slot).
An iteration:
  1. propose: up to min(K, budget left - 1) drafts per slot from its history (so no slot outgrows its budget);
  2. verify: one forward pass over every slot's rows, packed ragged (its last token, then its drafts; a slot
     past its budget has one row written to the spare page), padded to the block's T rows (a bucket of at least
     K + 1 per live slot) whether or not any slot has a draft: a lax.cond choosing a 1-row forward carried the KV
     cache through both branches, and XLA on CPU copied it whole each iteration (2.7 s a block with tinypy's 32768
     pages, measured);
  3. accept (the speculation's rule, acceptance.py: greedy is exact match; sample-and-match draws row j with the
     slot's seed and output index, as a step without speculation would): the leading passed drafts, then the
     sampled token at the first rejected row (or the bonus row);
  4. append those tokens to the slot's history and output; its last token and position move on.
The K/V of the accepted tokens is in place (rejected drafts' K/V lies past the new last token, overwritten before
it is ever read: attention is causal). EOS and stop tokens are the host's business, as in blocks of decode steps: a
slot computes on past them and the host drops the rest. The loop ends after N iterations or when every slot has
spent its budget.

Returns per slot (padded to max_num_seqs rows) one int32 row: its tokens [N (K + 1)] (the first `count` valid),
its count, then per iteration the drafts it verified [N] and how many passed [N] (the speculator's tallies).
"""

import dataclasses

import jax
import jax.numpy as jnp

from cbjax.model.llama import AttentionMetadata
from cbjax.runner.speculation.acceptance import first_rejection
from cbjax.runner.speculation.ngram_device import propose_ngram


@dataclasses.dataclass(frozen=True)
class BlockShape:
    """Static: N iterations of up to K drafts, prompt lookup of min_n..max_n tokens (hashable: a jit key)."""

    iterations: int
    max_drafts: int
    min_n: int
    max_n: int

    @property
    def max_tokens(self) -> int:
        return self.iterations * (self.max_drafts + 1)

    @property
    def row_width(self) -> int:
        """Columns of a slot's result row: tokens, count, drafted per iteration, accepted per iteration."""
        return self.max_tokens + 1 + 2 * self.iterations


def result_columns(shape: BlockShape) -> tuple[slice, int, slice, slice]:
    """Where a result row keeps its tokens, its count, its drafts per iteration and its accepted per iteration."""
    M, N = shape.max_tokens, shape.iterations
    return slice(0, M), M, slice(M + 1, M + 1 + N), slice(M + 1 + N, M + 1 + 2 * N)


def speculative_block(model, kv_caches, inp, token_ids, history, budgets, shape: BlockShape, rule, run_model):
    """`inp`: the first step (StepInput, decodes only); token_ids [T]; history [S, L] int32; budgets [S] int32;
    `rule`: the acceptance rule; `run_model(token_ids, positions, kv_caches, metadata)` -> (hidden, kv_caches).
    Returns (results [S, shape.row_width] int32, kv_caches)."""
    S, L = history.shape
    K, N, M = shape.max_drafts, shape.iterations, shape.max_tokens
    k_pages = kv_caches[0][0]
    G, spare_slot = k_pages.shape[2], (k_pages.shape[1] - 1) * k_pages.shape[2]
    W = inp.page_indices.shape[1]
    R = inp.token_ids.shape[0]  # the forward's rows: the block's bucket T >= live slots * (K + 1) (the scheduler's)
    n_live = inp.num_seqs[0]
    live = jnp.arange(S) < n_live
    sampling = (inp.temperature, inp.top_k, inp.top_p, inp.seeds)
    start = inp.positions[:S]  # each slot's last token's position before the block
    produced_of = lambda pos: pos - start

    def forward(last, pos, active, drafts, counts, kv):
        """Each active slot's rows (its last token, then its drafts) through the model, packed ragged: slot s's
        rows lead at cu[s] (an inactive live slot: one row at position 0, written to the spare page), padding rows
        after all of them. Returns each row's sampled token and whether its draft passed, [S, K + 1] (rows past a
        slot's drafts: anything), and kv."""
        j = jnp.arange(K + 1)
        q_lens = jnp.where(active, counts + 1, jnp.where(live, 1, 0))
        cu = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(q_lens)]).astype(jnp.int32)
        at = jnp.where(j[None, :] < q_lens[:, None], cu[:S, None] + j, R)  # [S, K + 1] -> flat row (R: dropped)
        flat = lambda x, fill=0: jnp.full(R, fill, x.dtype).at[at].set(jnp.broadcast_to(x, at.shape), mode="drop")
        gather = lambda x: x[jnp.minimum(at, R - 1)]
        positions = jnp.where(active, pos, 0)[:, None] + j
        page = jnp.take_along_axis(inp.page_indices, jnp.minimum(positions // G, W - 1), axis=1)
        slots = jnp.where(active[:, None], page * G + positions % G, spare_slot)
        tokens = jnp.concatenate([last[:, None], jnp.maximum(drafts, 0)], axis=1)  # [S, K + 1]
        # kv_lens: each row's position is kv_len - q_len + its index (the ragged kernels' contract), so an active
        # slot's context ends at its last row and never runs past the pages the scheduler gave it.
        kv_lens = jnp.where(active, pos + q_lens, jnp.where(live, 1, 0)).astype(jnp.int32)
        md = AttentionMetadata(flat(slots, spare_slot), kv_lens, inp.page_indices, cu, inp.num_seqs)
        hidden, kv = run_model(flat(tokens), flat(positions.astype(jnp.int32)), kv, md)
        logits = model.logits(hidden, valid_rows=cu[-1:])  # [R, V]: the slots' rows lead
        row_drafts = jnp.where(j[None, :] < counts[:, None], jnp.pad(drafts, ((0, 0), (0, 1))), -1)
        counters = inp.counters[:, None] + produced_of(pos)[:, None] + j
        per_row = [flat(x[:, None]) for x in sampling]
        sampled, passed = rule(logits, flat(row_drafts, -1), *per_row, flat(counters))
        return gather(sampled), gather(passed), kv

    def iteration(carry):
        i, kv, last, pos, history, out, drafted, accepted = carry
        produced = produced_of(pos)
        active = live & (produced < budgets)
        want = jnp.where(active, jnp.clip(budgets - produced - 1, 0, K), 0)
        drafts, counts = propose_ngram(history[:, :L], pos + 1, want, shape.min_n, shape.max_n, K)
        sampled, passed, kv = forward(last, pos, active, drafts, counts, kv)
        n_passed = first_rejection(passed, counts)
        j = jnp.arange(K + 1)[None, :]
        new = jnp.where(j < n_passed[:, None], jnp.pad(drafts, ((0, 0), (0, 1))), sampled)  # [S, K + 1]
        n_new = jnp.where(active, n_passed + 1, 0)
        keep = j < n_new[:, None]
        rows = jnp.arange(S)[:, None]
        out = out.at[rows, jnp.where(keep, produced[:, None] + j, M)].set(new)  # (column M: the dump)
        history = history.at[rows, jnp.where(keep, pos[:, None] + 1 + j, L)].set(new)  # (column L: the dump)
        last = jnp.where(active, new[jnp.arange(S), jnp.maximum(n_new - 1, 0)], last)
        drafted = drafted.at[:, i].set(counts)
        accepted = accepted.at[:, i].set(jnp.where(active, n_passed, 0))
        return i + 1, kv, last, pos + n_new, history, out, drafted, accepted

    def going(carry):
        i, pos = carry[0], carry[3]
        return (i < N) & jnp.any(live & (produced_of(pos) < budgets))

    history = jnp.pad(history, ((0, 0), (0, 1)))
    out = jnp.zeros((S, M + 1), jnp.int32)
    stats = jnp.zeros((S, N), jnp.int32)
    carry = (jnp.int32(0), kv_caches, token_ids[:S], start, history, out, stats, stats)
    _, kv_caches, _, pos, _, out, drafted, accepted = jax.lax.while_loop(going, iteration, carry)
    count = jnp.where(live, produced_of(pos), 0)
    return jnp.concatenate([out[:, :M], count[:, None], drafted, accepted], axis=1).astype(jnp.int32), kv_caches
