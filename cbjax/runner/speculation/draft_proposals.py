"""A draft model's proposals inside a verifying step (speculative_config method "draft"), on the device.

The draft model has its own paged KV cache with the target's geometry and follows the target's page tables: a
token's draft K/V live at the same (page, offset) as its target K/V. Before a verifying step the runner brings each
speculating sequence's draft KV up to its computed tokens (draft_runner.py: the draft's prefill, run only for
sequences that speculate). Then, in the step's program, before the target's forward:

  iteration 0: the draft computes the sequence's own last token (position q) -> draft 1 (position q + 1);
  iteration i = 1..d: it computes draft i (position q + i) -> draft i + 1 (the last one's output is unused).

so every position the target computes in the step (q .. q + d) also gets its draft K/V, and whatever the target
accepts, the draft's KV holds every accepted token: no catch-up in the next step when the sequence speculates
again. Rejected positions are overwritten later, never read (attention reads up to the computed length).

Each iteration is one decode row per slot (the decode attention path); sequences with fewer drafts, or none, sit
the later iterations out (their writes go to the spare page). The loop runs max(d) + 1 times, a runtime bound.
A draft is the draft's greedy token for greedy requests, else a sample of q: the draft's distribution after the
request's temperature, top-k and top-p, with its own PRNG stream (acceptance.DRAFT_STREAM); q is returned for
the rejection rule (acceptance.RejectionSampling).
"""

import jax
import jax.numpy as jnp

from cbjax.model.llama import AttentionMetadata
from cbjax.runner.sampler import argmax_last, gumbel_argmax, row_keys, sampling_logits
from cbjax.runner.sampling_extras import unpack_bitmask
from cbjax.runner.speculation.acceptance import DRAFT_STREAM


def own_token_index(inp):
    """[S]: flat index of each slot's own last context token (its drafts follow it in its query chunk)."""
    return inp.cu_q_lens[1:] - 1 - inp.verify.slot_num_drafts


def propose_drafts(
    draft_model, draft_kv, token_ids, inp, max_drafts: int, page_size: int, backend: str, interpret, first_allowed=None
):
    """-> (drafts [S, K] int32, q [S, K, V] float32 (zeros when every request is greedy), updated draft KV).
    `token_ids`: the step's flat tokens with pending tokens already in place; `inp` a StepInput with verify rows;
    `first_allowed` [S, ceil(V / 32)] int32: a bitmask each slot's first draft is drawn under (structured output:
    its grammar's mask at the committed outputs, constrained_verify.py; q is then the masked distribution it was
    drawn from), None: no mask."""
    S, K, G, T = inp.kv_lens.shape[0], max_drafts, page_size, token_ids.shape[0]
    V = draft_model.cfg.vocab_size
    d = inp.verify.slot_num_drafts
    n = inp.num_seqs[0]
    slots = jnp.arange(S)
    live = slots < n
    own = token_ids[jnp.clip(own_token_index(inp), 0, T - 1)]
    q_pos = inp.kv_lens - d - 1  # the own token's position
    pad_row = (draft_kv[0][0].shape[1] - 1) * G  # the spare last page, which takes padding writes
    cu = jnp.minimum(jnp.arange(S + 1), n).astype(jnp.int32)
    greedy_step = jnp.all(inp.temperature == 0)

    def body(i, carry):
        kv, drafts, probs = carry
        active = live & (d > 0) & (i <= d)
        tokens = jnp.where(i == 0, own, drafts[:, jnp.maximum(i - 1, 0)])
        pos = jnp.where(active, q_pos + i, 0)
        page = inp.page_indices[slots, pos // G]
        slot_mapping = jnp.where(active, page * G + pos % G, pad_row)
        kv_lens = jnp.where(active, pos + 1, jnp.where(live, 1, 0))
        md = AttentionMetadata(slot_mapping, kv_lens, inp.page_indices, cu, inp.num_seqs)
        hidden, kv = draft_model(tokens, pos, kv, md, backend, interpret)
        logits = draft_model.logits(hidden)
        if first_allowed is not None:
            logits = jnp.where((i > 0) | unpack_bitmask(first_allowed, V), logits, -jnp.inf)
        greedy = argmax_last(logits)

        def sampled():
            x = sampling_logits(logits, inp.temperature, inp.top_k, inp.top_p)
            keys = row_keys(inp.seeds, inp.counters + i, DRAFT_STREAM)
            return gumbel_argmax(x, keys), jax.nn.softmax(x, axis=-1)

        drawn, q = jax.lax.cond(greedy_step, lambda: (greedy, jnp.zeros((S, V), jnp.float32)), sampled)
        new = jnp.where(inp.temperature == 0, greedy, drawn).astype(jnp.int32)
        j = jnp.minimum(i, K - 1)
        keep = i < K  # iteration K (d = K) only writes draft K's K/V
        drafts = drafts.at[:, j].set(jnp.where(keep, new, drafts[:, j]))
        probs = probs.at[:, j].set(jnp.where(keep, q, probs[:, j]))
        return kv, drafts, probs

    rounds = jnp.max(jnp.where(live, d, -1)) + 1  # 0 when no slot speculates
    init = (draft_kv, jnp.zeros((S, K), jnp.int32), jnp.zeros((S, K, V), jnp.float32))
    draft_kv, drafts, probs = jax.lax.fori_loop(0, rounds, body, init)
    return drafts, probs, draft_kv


def with_drafts(token_ids, inp, drafts):
    """The step's flat tokens with each slot's drafts in the positions after its own token (the host packed
    placeholders there)."""
    T, K = token_ids.shape[0], drafts.shape[1]
    j = jnp.arange(K)[None, :]
    d = inp.verify.slot_num_drafts[:, None]
    idx = jnp.where(j < d, own_token_index(inp)[:, None] + 1 + j, T)  # T: out of range, dropped
    return token_ids.at[idx.reshape(-1)].set(drafts.reshape(-1), mode="drop")


def row_draft_probs(inp, probs, rows: int):
    """q at the first `rows` verify rows: [rows, V] from the slots' [S, K, V] (a row without a draft gets its
    slot's last one, unused)."""
    v = inp.verify
    slot = v.row_slot[:rows]
    j = jnp.clip(v.row_counter[:rows] - inp.counters[slot], 0, probs.shape[1] - 1)
    return probs[slot, j]
