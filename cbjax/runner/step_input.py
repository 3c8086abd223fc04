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
from cbjax.runner.speculation.verify_rows import VerifyRows, empty_verify_rows, pack_verify_rows


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
    verify: VerifyRows | None = (
        None  # speculative decoding: the rows whose logits verify drafts (speculation/verify_rows.py)
    )
    # A block of decode steps (cbjax/runner/decode_loop.py): [S] int32, how many of the block's steps each slot runs.
    decode_steps: np.ndarray | None = None


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
    max_draft_tokens: int = 0  # K: speculative decoding verifies up to K drafts per sequence (0: off)

    @classmethod
    def build(
        cls,
        max_num_batched_tokens: int,
        max_model_len: int,
        page_size: int,
        max_num_seqs: int,
        min_tokens: int = 16,
        max_draft_tokens: int = 0,
    ) -> "BucketTable":
        tokens = token_buckets(min(min_tokens, max_num_batched_tokens), max_num_batched_tokens)
        return cls(tuple(tokens), max_num_seqs, page_size, -(-max_model_len // page_size), max_draft_tokens)

    @classmethod
    def from_config(cls, sched, cache, max_draft_tokens: int = 0) -> "BucketTable":
        """The table of an engine's resolved SchedulerConfig and CacheConfig (the shapes are derived from them)."""
        return cls.build(
            sched.max_num_batched_tokens, sched.max_model_len, cache.page_size, sched.max_num_seqs, 16, max_draft_tokens
        )

    def slots(self, T: int) -> int:
        return min(T, self.max_num_seqs)

    def verify_rows(self, T: int) -> int:
        """R: sample rows of a speculative step of bucket T (each is a distinct token, so never more than T)."""
        return min(T, self.slots(T) * (self.max_draft_tokens + 1))

    def token_bucket(self, n: int) -> int:
        for b in self.token_buckets:
            if n <= b:
                return b
        raise ValueError(f"{n} tokens exceed the largest token bucket {self.token_buckets[-1]}")


def empty_step_input(T: int, S: int, W: int, pad_page: int, page_size: int, num_verify_rows: int = 0) -> StepInput:
    """All-padding input of the given shape (also the base that pack_step fills in); with num_verify_rows > 0,
    the verify rows of a speculative step too."""
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
        verify=empty_verify_rows(num_verify_rows, S) if num_verify_rows else None,
    )


def pack_step(
    out: SchedulerOutput,
    buckets: BucketTable,
    pad_page: int,
    prev_slot_of: Mapping[Request, int],
    verify: bool = False,
) -> tuple[StepInput, list[int]]:
    """Lay the scheduled sequences out as one flat padded batch, decodes first (the attention's decode loop then
    visits only the leading slots). Returns the input and `order`: slot i holds out.seqs[order[i]].

    A pending token (sampled by the previous step, not yet on the host) is read on the device from that step's
    output: `prev_slot_of` gives each request's slot in it.

    Python touches each sequence once, collecting plain lists; numpy builds every array from them in one call
    (a numpy call per sequence and field cost more than the rest of the step's host work at 64 sequences)."""
    G = buckets.page_size
    seqs = out.seqs
    n = len(seqs)
    order = [i for i in range(n) if seqs[i].num_new_tokens == 1] + [i for i in range(n) if seqs[i].num_new_tokens > 1]
    T = buckets.token_bucket(out.num_batched_tokens)
    inp = empty_step_input(T, buckets.slots(T), buckets.pages_per_seq, pad_page, G)
    drafts = [len(seqs[j].draft_token_ids) for j in order]
    tokens: list[int] = []
    starts, lens, pending, params, counters, pages, num_pages, dropped = [], [], [], [], [], [], [], []
    for j, d in zip(order, drafts):
        s = seqs[j]
        r = s.request
        c, k = s.num_computed_tokens, s.num_new_tokens
        tokens += r.all_token_ids[c : c + k - d]
        if tokens[-1] == PENDING_TOKEN:  # only ever a decode's input
            tokens[-1] = 0
            pending.append((len(tokens) - 1, prev_slot_of[r]))
        if d:
            tokens += s.draft_token_ids
        starts.append(c)
        lens.append(k)
        pages += r.pages
        num_pages.append(len(r.pages))
        dropped.append(r.num_dropped_pages)
        params.append(r.params)
        counters.append((r.seed, c + k - d - r.num_prompt_tokens))  # the index of the output this slot samples
    total = len(tokens)
    q_lens = np.asarray(lens, np.int32)
    cu = np.cumsum(q_lens, dtype=np.int32)
    seq_of_token = np.repeat(np.arange(n, dtype=np.int32), q_lens)
    positions = np.arange(total, dtype=np.int32) + np.repeat(np.asarray(starts, np.int32) - (cu - q_lens), q_lens)
    pt = inp.page_indices
    # Row-major: each row's pages in order, from the column of its first held page (pages a sliding window has
    # dropped keep the pad page: attention never reads them).
    first, cols = np.asarray(dropped)[:, None], np.arange(pt.shape[1])
    pt[:n][(cols >= first) & (cols < first + np.asarray(num_pages)[:, None])] = pages
    inp.token_ids[:total] = tokens
    inp.positions[:total] = positions
    inp.slot_mapping[:total] = pt[seq_of_token, positions // G] * G + positions % G
    for t, slot in pending:
        inp.token_src[t] = slot
    inp.kv_lens[:n] = np.asarray(starts, np.int32) + q_lens
    inp.cu_q_lens[1 : n + 1] = cu
    inp.cu_q_lens[n + 1 :] = total
    inp.num_seqs[0] = n
    inp.sample_idx[:n] = cu - 1
    inp.temperature[:n] = [p.temperature for p in params]
    inp.top_k[:n] = [p.top_k for p in params]
    inp.top_p[:n] = [p.top_p for p in params]
    if n:
        inp.seeds[:n], inp.counters[:n] = zip(*counters)
    if out.num_steps > 1:  # a block of decode steps (decode_loop.py): how many each slot runs
        steps = np.zeros(buckets.slots(T), np.int32)
        steps[:n] = [seqs[j].num_steps for j in order]
        inp = inp._replace(decode_steps=steps)
    if verify:  # a speculative step (speculation/verify_rows.py)
        verify = pack_verify_rows(buckets.verify_rows(T), buckets.slots(T), cu, drafts, inp.counters[:n], inp.token_ids)
        inp = inp._replace(verify=verify)
    return inp, order
