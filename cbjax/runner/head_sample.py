"""The LM head and the sampler of a step: on each sequence's last token only, and on the leading rows only when
the step's sequences fit there."""

import jax
import jax.numpy as jnp

from cbjax.runner.sampler import sample
from cbjax.runner.step_input import StepInput

# A step's S slots follow its token bucket (S = min(T, max_num_seqs)), but a big prefill step holds few sequences:
# the LM head over all S rows cost ~100 ms of a 450 ms llama-small prefill step. When the live sequences fit in
# the first HEAD_ROWS rows, only those rows go through the head and the sampler (rows past num_seqs are padding).
HEAD_ROWS = 32


def head_and_sample(model, hidden, inp: StepInput):
    """Tokens [S] for the step's S slots: the LM head only on each sequence's last token ([S, V], not [T, V])."""

    def rows_head_and_sample(rows: int):
        h = hidden[inp.sample_idx[:rows]]  # rows past num_seqs: padding (temperature 0)
        params = [x[:rows] for x in (inp.temperature, inp.top_k, inp.top_p, inp.seeds, inp.counters)]
        full = lambda: sample(model.logits(h, valid_rows=inp.num_seqs), *params)
        if not model.fuses_greedy_head:
            return full()
        # An all-greedy step skips the [rows, V] logits: the LM head's argmax, fused (the same values, the same
        # pick as the sampler's greedy argmax).
        return jax.lax.cond(jnp.all(params[0] == 0), lambda: model.greedy_tokens(h, inp.num_seqs), full)

    S = inp.sample_idx.shape[0]
    if S <= HEAD_ROWS:
        return rows_head_and_sample(S)
    few = lambda: jnp.zeros((S,), jnp.int32).at[:HEAD_ROWS].set(rows_head_and_sample(HEAD_ROWS))
    return jax.lax.cond(inp.num_seqs[0] <= HEAD_ROWS, few, lambda: rows_head_and_sample(S))
