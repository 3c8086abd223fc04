"""How the ragged kernels tile a flat batch: the live cu_q_lens, the sequences owning rows in each query block,
and the per-row facts of one block (`BlockRows`), shared by the TPU (ragged_paged_attention.py) and GPU
(ragged_paged_attention_gpu.py) kernels."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl


def valid_cu_q_lens(cu_q_lens: jax.Array, num_seqs: jax.Array) -> jax.Array:
    # Entries past num_seqs are unspecified; repeating the total there turns the
    # ignored sequences into empty ones, so searches never land on them.
    num = jnp.clip(num_seqs[0], 0, cu_q_lens.shape[0] - 1)
    idx = jnp.arange(cu_q_lens.shape[0])
    return jnp.where(idx <= num, cu_q_lens, cu_q_lens[num])


def block_seq_ranges(cu: jax.Array, num_tokens: int, block_q: int):
    """[first, last) sequences owning rows in each block of block_q tokens."""
    starts = jnp.arange(pl.cdiv(num_tokens, block_q), dtype=jnp.int32) * block_q
    ends = jnp.minimum(starts + block_q, cu[-1])
    first = jnp.searchsorted(cu[1:], starts, side="right").astype(jnp.int32)
    last = jnp.searchsorted(cu[1:], ends - 1, side="right").astype(jnp.int32) + 1
    return first, jnp.where(ends > starts, last, first)


class BlockRows:
    """Per-row facts of one query block, shared by the two kernels.

    Rows are (token, head) pairs, token-major: row // r_pad is the token offset
    inside the block.
    """

    def __init__(self, block_start, num_rows, rows_per_token):
        shift = rows_per_token.bit_length() - 1  # r_pad is a power of two
        row = lax.broadcasted_iota(jnp.int32, (num_rows, 1), 0)
        self.token = block_start + lax.shift_right_logical(row, shift)  # [R, 1]
        self.start = block_start
        self.stop = block_start + num_rows // rows_per_token

    def seq_window(self, q_start, q_end, kv_len, sliding_window):
        """The kv token range [lo, hi) this block's rows of one sequence see."""
        ctx0 = kv_len - (q_end - q_start)  # position of the sequence's query 0
        first = jnp.maximum(q_start, self.start)
        last = jnp.minimum(q_end, self.stop) - 1
        hi = ctx0 + last - q_start + 1
        lo = 0
        if sliding_window is not None:
            lo = jnp.maximum(ctx0 + first - q_start - sliding_window + 1, 0)
        return lo, jnp.where(last >= first, hi, lo)

    def score_mask(self, q_start, q_end, kv_len, pos_row, sliding_window):
        """bool [R, C]: row may attend to kv token pos_row [1, C]."""
        q_pos = kv_len - (q_end - q_start) + self.token - q_start  # [R, 1]
        ok = (self.token >= q_start) & (self.token < q_end) & (pos_row <= q_pos)
        if sliding_window is not None:
            ok &= pos_row > q_pos - sliding_window
        return ok
