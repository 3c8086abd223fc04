"""StepInput: one step of the scheduler's output as fixed-shape, padded int32 arrays, and the bucket table.

The only shape that varies is the token bucket T (powers of two and their 1.5x midpoints, from 16 up to
max_num_batched_tokens): the slot count is S = min(T, max_num_seqs) (a step cannot hold more sequences than
tokens) and the page-table width W covers max_model_len. Attention work follows the real lengths at run time
(kernels_pallas/xla_attention.py), so wider page tables cost nothing but their bytes. One compiled program per
token bucket, all compiled at warmup.
"""

import dataclasses
import typing
from collections.abc import Mapping

import numpy as np

from cbjax.core.request import PENDING_TOKEN, Request
from cbjax.core.scheduler_output import SchedulerOutput


class StepInput(typing.NamedTuple):
    token_ids: np.ndarray  # [T] int32
    # [T] int32: -1, or the slot of the previous step whose sampled token (not yet on the host) is this token
    token_src: np.ndarray
    positions: np.ndarray  # [T] int32
    slot_mapping: np.ndarray  # [T] int32: page * G + offset; padding -> the spare page
    kv_lens: np.ndarray  # [S] int32: context length after this step (0 = empty slot)
    page_indices: np.ndarray  # [S, W] int32
    cu_q_lens: np.ndarray  # [S+1] int32
    num_seqs: np.ndarray  # [1] int32
    sample_idx: np.ndarray  # [S] int32: flat index of each sequence's last token this step
    temperature: np.ndarray  # [S] float32 (0 = greedy; padding slots are greedy)
    top_k: np.ndarray  # [S] int32 (<= 0: off)
    top_p: np.ndarray  # [S] float32
    seeds: np.ndarray  # [S] uint32
    counters: np.ndarray  # [S] int32: index of the token each slot samples


def token_buckets(lo: int, hi: int) -> list[int]:
    """Powers of two and their 1.5x midpoints in [lo, hi], plus hi: padding waste stays under a third."""
    out, b = [], lo
    while b < hi:
        out.append(b)
        if b * 3 // 2 < hi and b >= 16:
            out.append(b * 3 // 2)
        b *= 2
    out.append(hi)
    return sorted(set(out))


@dataclasses.dataclass(frozen=True)
class BucketTable:
    token_buckets: tuple[int, ...]
    max_num_seqs: int
    page_size: int
    pages_per_seq: int  # W

    @classmethod
    def build(
        cls, max_num_batched_tokens: int, max_model_len: int, page_size: int, max_num_seqs: int, min_tokens: int = 16
    ) -> "BucketTable":
        tokens = token_buckets(min(min_tokens, max_num_batched_tokens), max_num_batched_tokens)
        return cls(tuple(tokens), max_num_seqs, page_size, -(-max_model_len // page_size))

    def slots(self, T: int) -> int:
        return min(T, self.max_num_seqs)

    def token_bucket(self, n: int) -> int:
        for b in self.token_buckets:
            if n <= b:
                return b
        raise ValueError(f"{n} tokens exceed the largest token bucket {self.token_buckets[-1]}")


def empty_step_input(T: int, S: int, W: int, pad_page: int, page_size: int) -> StepInput:
    """All-padding input of the given shape (also the base that pack_step fills in)."""
    return StepInput(
        token_ids=np.zeros(T, np.int32),
        token_src=np.full(T, -1, np.int32),
        positions=np.zeros(T, np.int32),
        slot_mapping=np.full(T, pad_page * page_size, np.int32),
        kv_lens=np.zeros(S, np.int32),
        page_indices=np.full((S, W), pad_page, np.int32),
        cu_q_lens=np.zeros(S + 1, np.int32),
        num_seqs=np.zeros(1, np.int32),
        sample_idx=np.zeros(S, np.int32),
        temperature=np.zeros(S, np.float32),
        top_k=np.zeros(S, np.int32),
        top_p=np.ones(S, np.float32),
        seeds=np.zeros(S, np.uint32),
        counters=np.zeros(S, np.int32),
    )


def pack_step(
    out: SchedulerOutput, buckets: BucketTable, pad_page: int, prev_slot_of: Mapping[Request, int]
) -> tuple[StepInput, list[int]]:
    """Lay the scheduled sequences out as one flat padded batch, decodes first (the attention's decode loop then
    visits only the leading slots). Returns the input and `order`: slot i holds out.seqs[order[i]].

    A pending token (sampled by the previous step, not yet on the host) is read on the device from that step's
    output: `prev_slot_of` gives each request's slot in it."""
    G = buckets.page_size
    seqs = out.seqs
    order = sorted(range(len(seqs)), key=lambda i: seqs[i].num_new_tokens > 1)
    T = buckets.token_bucket(out.num_batched_tokens)
    inp = empty_step_input(T, buckets.slots(T), buckets.pages_per_seq, pad_page, G)
    tok, pos, slot, pt = inp.token_ids, inp.positions, inp.slot_mapping, inp.page_indices
    off = 0
    for i, j in enumerate(order):
        s = seqs[j]
        r = s.request
        c, k = s.num_computed_tokens, s.num_new_tokens
        tok[off : off + k] = r.all_token_ids[c : c + k]
        if r.all_token_ids[c + k - 1] == PENDING_TOKEN:  # only ever a decode's input
            tok[off + k - 1] = 0
            inp.token_src[off + k - 1] = prev_slot_of[r]
        if k == 1:
            pos[off] = c
            slot[off] = r.pages[c // G] * G + c % G
        else:
            p = np.arange(c, c + k, dtype=np.int32)
            pos[off : off + k] = p
            slot[off : off + k] = np.asarray(r.pages, np.int32)[p // G] * G + p % G
        pt[i, : len(r.pages)] = r.pages
        off += k
        inp.kv_lens[i] = c + k
        inp.cu_q_lens[i + 1] = off
        inp.sample_idx[i] = off - 1
        sp = r.params
        inp.temperature[i] = sp.temperature
        inp.top_k[i] = sp.top_k
        inp.top_p[i] = sp.top_p
        inp.seeds[i] = r.seed
        inp.counters[i] = c + k - r.num_prompt_tokens  # the index of the output this slot samples
    inp.cu_q_lens[len(seqs) + 1 :] = off
    inp.num_seqs[0] = len(seqs)
    return inp, order
