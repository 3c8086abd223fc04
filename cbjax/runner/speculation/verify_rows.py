"""The verify rows of a speculative step: which token positions get logits, and what each one checks.

A sequence with d drafts computes its last context token and the d drafts in one query chunk; the logits at those
1 + d positions predict the next 1 + d tokens. Row j of the sequence samples output index (its counter + j) and
checks that sample against draft j (the token at the next position of the chunk); its last row has no draft (the
bonus token). A sequence without drafts has one row: its last token. Rows are flat over the step, padded to a
fixed R per token bucket (R = min(T, S * (K + 1))), so a new mix of drafts never recompiles.
"""

import typing

import numpy as np


class VerifyRows(typing.NamedTuple):
    row_idx: np.ndarray  # [R] int32: flat token index of the row (padding: 0)
    row_slot: np.ndarray  # [R] int32: the row's slot (its sampling parameters and seed)
    row_draft: np.ndarray  # [R] int32: the draft this row's sample is checked against; -1: none
    row_counter: np.ndarray  # [R] int32: the output index this row samples
    num_rows: np.ndarray  # [1] int32: live rows
    slot_row_start: np.ndarray  # [S] int32: each slot's first row
    slot_num_drafts: np.ndarray  # [S] int32


def empty_verify_rows(R: int, S: int) -> VerifyRows:
    return VerifyRows(
        row_idx=np.zeros(R, np.int32),
        row_slot=np.zeros(R, np.int32),
        row_draft=np.full(R, -1, np.int32),
        row_counter=np.zeros(R, np.int32),
        num_rows=np.zeros(1, np.int32),
        slot_row_start=np.zeros(S, np.int32),
        slot_num_drafts=np.zeros(S, np.int32),
    )


def pack_verify_rows(R: int, S: int, cu_q_lens: np.ndarray, drafts, counters: np.ndarray, token_ids: np.ndarray):
    """cu_q_lens [n]: each live slot's chunk end (flat); drafts [n]: its drafts (the chunk's last d tokens);
    counters [n]: the output index of its first row; token_ids: the step's flat tokens (drafts included)."""
    v = empty_verify_rows(R, S)
    n = len(drafts)
    if not n:
        return v
    per_slot = np.asarray(drafts, np.int32) + 1
    starts = np.cumsum(per_slot, dtype=np.int32) - per_slot
    total = int(per_slot.sum())
    slot = np.repeat(np.arange(n, dtype=np.int32), per_slot)
    j = np.arange(total, dtype=np.int32) - starts[slot]  # row's index within its slot
    idx = cu_q_lens[slot] - per_slot[slot] + j
    v.row_idx[:total] = idx
    v.row_slot[:total] = slot
    has_draft = j < per_slot[slot] - 1
    v.row_draft[:total] = np.where(has_draft, token_ids[np.minimum(idx + 1, token_ids.shape[0] - 1)], -1)
    v.row_counter[:total] = counters[slot] + j
    v.num_rows[0] = total
    v.slot_row_start[:n] = starts
    v.slot_num_drafts[:n] = per_slot - 1
    return v


def verified_tokens(seqs, order, host_tokens: np.ndarray) -> list:
    """A speculative step's result per scheduled sequence, in `seqs` order (`order[i]`: the sequence of packed row i):
    the list of its accepted drafts and sampled token where it had drafts, else its one sampled token (an int), as
    Scheduler.update takes them."""
    result: list = [0] * len(order)
    for i, j in enumerate(order):
        row = host_tokens[i]
        result[j] = row[: row[-1]].tolist() if seqs[j].draft_token_ids else int(row[0])
    return result
