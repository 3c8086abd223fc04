"""A block of decode steps in one program: the device runs the model N times, feeding each step's sampled tokens to
the next, so the host schedules, packs, launches and receives once per N steps (cbjax/core/multi_step.py says
when the scheduler plans such a block).

The block's input is its first step, packed as usual (decodes only: token t is slot t's one token). Step i moves
every slot that runs it (i < decode_steps[slot]) one position on: position + i, context length + i, sampling
counter + i, and its KV write goes to the page of that position (the scheduler allocated the pages for the whole
block). A slot past its steps writes to the spare page and keeps its context length; its tokens are ignored.
The loop runs max(decode_steps) times (a trip count known only at run time), so one program per token bucket
serves every block of up to N steps. With a token stream (token_stream.py, CPU only) each step's tokens are also
written to the host as the step ends, for a streaming engine to take one row per step(), and the loop ends early
when the host asks (a request arrived: it should not wait for the block's end to be admitted).
"""

import jax
import jax.numpy as jnp

from cbjax.model.llama import AttentionMetadata
from cbjax.runner.head_sample import head_and_sample
from cbjax.runner.step_input import StepInput


def decode_block(
    model, kv_caches, inp: StepInput, token_ids, num_steps: int, max_num_seqs: int, run_model, stream=None
):
    """Run max(inp.decode_steps) <= `num_steps` decode steps; `token_ids` [T] are the first step's (pending tokens
    already read in). `run_model(token_ids, positions, kv_caches, metadata)` -> (hidden, kv_caches). `stream`:
    (the token stream's FFI target, its meta [5] int32) or None: the host may then end the block after any step
    (the stream's stop word). Returns (tokens [num_steps, max_num_seqs] (rows of steps that did not run: -1), the
    last run step's tokens [max_num_seqs], kv_caches)."""
    T, S = inp.token_ids.shape[0], inp.kv_lens.shape[0]  # (T >= S: a step holds no more slots than tokens)
    k_pages = kv_caches[0][0]
    G, spare_slot = k_pages.shape[2], (k_pages.shape[1] - 1) * k_pages.shape[2]
    steps_of_token = jnp.zeros(T, jnp.int32).at[:S].set(inp.decode_steps)
    slot_of_token = jnp.minimum(jnp.arange(T), S - 1)

    def step(carry):
        i, ids, kv, tokens, _ = carry
        positions = inp.positions + i
        page = inp.page_indices[slot_of_token, positions // G]  # (clamped where positions run past a short row)
        slots = jnp.where(i < steps_of_token, page * G + positions % G, spare_slot)
        kv_lens = jnp.where(i < inp.decode_steps, inp.kv_lens + i, inp.kv_lens)
        md = AttentionMetadata(slots, kv_lens, inp.page_indices, inp.cu_q_lens, inp.num_seqs)
        hidden, kv = run_model(ids, positions, kv, md)
        sampled = head_and_sample(model, hidden, inp._replace(counters=inp.counters + i))
        row = jnp.zeros(max_num_seqs, jnp.int32).at[:S].set(sampled)
        stop = jnp.int32(0)
        if stream is not None:  # (it returns the row: the loop reads its output, so it is never dropped)
            target, meta = stream
            out = (jax.ShapeDtypeStruct(row.shape, jnp.int32), jax.ShapeDtypeStruct((), jnp.int32))
            row, stop = jax.ffi.ffi_call(target, out)(meta, i, row)
        return i + 1, jnp.zeros(T, jnp.int32).at[:S].set(sampled), kv, tokens.at[i].set(row), stop

    # Rows of steps that do not run stay -1 (no token id is negative): how the host counts the steps of a block that
    # ended early because it asked it to (token_stream.py: a request arrived).
    tokens = jnp.full((num_steps, max_num_seqs), -1, jnp.int32)
    trips = jnp.minimum(jnp.max(inp.decode_steps), num_steps)
    carry = (jnp.int32(0), token_ids, kv_caches, tokens, jnp.int32(0))
    ran, _, kv_caches, tokens, _ = jax.lax.while_loop(lambda c: (c[0] < trips) & (c[4] == 0), step, carry)
    return tokens, tokens[jnp.maximum(ran - 1, 0)], kv_caches
