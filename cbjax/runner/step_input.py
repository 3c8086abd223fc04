"""StepInput: one step of the scheduler's output as fixed-shape, padded int32 arrays, and the bucket table.

Shapes are fixed by (T, W): T = token bucket (powers of two from 16 up to max_num_batched_tokens), W = page-table
width bucket (powers of two; W * G bounds both the longest decode context and the summed context of the step's
multi-token sequences, see kernels_pallas/xla_attention.py). B = max_num_seqs slots is fixed per engine. Each
(T, W) pair is one compiled program; all of them are compiled at warmup.
"""
import dataclasses
import typing

import numpy as np

from cbjax.core.scheduler import SchedulerOutput


class StepInput(typing.NamedTuple):
    token_ids: np.ndarray  # [T] int32
    positions: np.ndarray  # [T] int32
    slot_mapping: np.ndarray  # [T] int32: page * G + offset; padding -> the spare page
    kv_lens: np.ndarray  # [B] int32: context length after this step (0 = empty slot)
    page_indices: np.ndarray  # [B, W] int32
    cu_q_lens: np.ndarray  # [B+1] int32
    num_seqs: np.ndarray  # [1] int32
    sample_idx: np.ndarray  # [B] int32: flat index of each sequence's last token this step
    temperature: np.ndarray  # [B] float32 (0 = greedy; padding slots are greedy)
    top_k: np.ndarray  # [B] int32 (<= 0: off)
    top_p: np.ndarray  # [B] float32
    seeds: np.ndarray  # [B] uint32
    counters: np.ndarray  # [B] int32: index of the token each slot samples


def _powers_of_two(lo: int, hi: int) -> list[int]:
    out, b = [], lo
    while b < hi:
        out.append(b)
        b *= 2
    out.append(hi)
    return out


@dataclasses.dataclass(frozen=True)
class BucketTable:
    token_buckets: tuple[int, ...]
    page_buckets: tuple[int, ...]  # page-table widths W
    page_size: int
    max_num_seqs: int

    @classmethod
    def build(cls, max_num_batched_tokens: int, max_model_len: int, page_size: int, max_num_seqs: int,
              min_tokens: int = 16, min_kv_tokens: int = 128) -> "BucketTable":
        tokens = _powers_of_two(min(min_tokens, max_num_batched_tokens), max_num_batched_tokens)
        # Room for the longest context plus a full step of prefill tokens from other sequences.
        max_pages = -(-(max_model_len + max_num_batched_tokens) // page_size)
        top = 1 << (max_pages - 1).bit_length()
        lo = min(max(1, min_kv_tokens // page_size), top)
        return cls(tuple(tokens), tuple(_powers_of_two(lo, top)), page_size, max_num_seqs)

    @property
    def max_prefill_kv_tokens(self) -> int:
        return self.page_buckets[-1] * self.page_size

    def shapes(self) -> list[tuple[int, int]]:
        return [(t, w) for t in self.token_buckets for w in self.page_buckets]

    def token_bucket(self, n: int) -> int:
        for b in self.token_buckets:
            if n <= b:
                return b
        raise ValueError(f"{n} tokens exceed the largest token bucket {self.token_buckets[-1]}")

    def page_bucket(self, num_pages: int) -> int:
        for b in self.page_buckets:
            if num_pages <= b:
                return b
        raise ValueError(f"{num_pages} pages exceed the largest page bucket {self.page_buckets[-1]}")


def empty_step_input(T: int, W: int, B: int, pad_page: int, page_size: int) -> StepInput:
    """All-padding input of the given bucket shape (for warmup)."""
    return StepInput(
        token_ids=np.zeros(T, np.int32), positions=np.zeros(T, np.int32),
        slot_mapping=np.full(T, pad_page * page_size, np.int32), kv_lens=np.zeros(B, np.int32),
        page_indices=np.full((B, W), pad_page, np.int32), cu_q_lens=np.zeros(B + 1, np.int32),
        num_seqs=np.zeros(1, np.int32), sample_idx=np.zeros(B, np.int32), temperature=np.zeros(B, np.float32),
        top_k=np.zeros(B, np.int32), top_p=np.ones(B, np.float32), seeds=np.zeros(B, np.uint32),
        counters=np.zeros(B, np.int32))


def pack_step(out: SchedulerOutput, buckets: BucketTable, pad_page: int) -> StepInput:
    """Lay the scheduled sequences out as one flat, padded batch (sequences in scheduling order)."""
    G, B = buckets.page_size, buckets.max_num_seqs
    seqs = out.seqs
    max_decode_kv = prefill_kv = max_pages = 0
    for s in seqs:
        kv = s.num_computed + s.num_new_tokens
        if s.num_new_tokens == 1:
            max_decode_kv = max(max_decode_kv, kv)
        else:
            prefill_kv += kv
        max_pages = max(max_pages, len(s.request.pages))
    T = buckets.token_bucket(out.num_batched_tokens)
    W = buckets.page_bucket(max(max_pages, -(-max(max_decode_kv, prefill_kv) // G)))
    inp = empty_step_input(T, W, B, pad_page, G)
    tok, pos, slot, pt = inp.token_ids, inp.positions, inp.slot_mapping, inp.page_indices
    off = 0
    for i, s in enumerate(seqs):
        r = s.request
        c, k = s.num_computed, s.num_new_tokens
        tok[off:off + k] = r.all_token_ids[c:c + k]
        if k == 1:
            pos[off] = c
            slot[off] = r.pages[c // G] * G + c % G
        else:
            p = np.arange(c, c + k, dtype=np.int32)
            pos[off:off + k] = p
            slot[off:off + k] = np.asarray(r.pages, np.int32)[p // G] * G + p % G
        pt[i, :len(r.pages)] = r.pages
        off += k
        inp.kv_lens[i] = c + k
        inp.cu_q_lens[i + 1] = off
        inp.sample_idx[i] = off - 1
        sp = r.params
        inp.temperature[i] = sp.temperature
        inp.top_k[i] = sp.top_k
        inp.top_p[i] = sp.top_p
        inp.seeds[i] = r.seed
        inp.counters[i] = len(r.output_token_ids)
    inp.cu_q_lens[len(seqs) + 1:] = off
    inp.num_seqs[0] = len(seqs)
    return inp
