"""StepPacker: each step's input, advanced from the previous step's when the batch did not change.

In the steady state of decoding the same sequences decode step after step, in the same order: each moves one
position on (or as many as it ran in the previous block of decode steps, cbjax/core/multi_step.py), its input
token is the one the previous step sampled (still on the device with asynchronous scheduling), and its page-table
row changes only when it gets a new page. Packing such a step from scratch
(pack_step) costs ~30 numpy calls and reads every sequence's token and page lists; inside a run on 2 cores each
numpy call costs several times what it costs alone (the step's threads share the cores and caches), and
pack_step was over a quarter of the host's work per step at 64 sequences of llama-tiny (docs/benchmarks.md,
"Host time at 64 running sequences", `experiments.throughput --host_split`). Advancing adds one vector to the
previous step's int32 buffer (positions, context lengths, slot mappings and sampling counters move by the steps
each slot ran) and writes by hand only what moved otherwise: the slot mapping of a sequence entering a new page, a
page-table row that gained or lost pages, the input tokens where they are not all pending, a block's steps per
slot. Any other step (a sequence joins, leaves or is preempted, a prefill chunk, drafts, a block after a single
step or the other way round) is packed from scratch.

Buffers are never changed once handed out: the previous step may still be reading its input (jax can alias a
numpy array on the CPU), so an advanced step gets a new buffer. The result equals pack_step's, field for field
(tests/runner/test_step_packer.py checks every step of the scheduler's randomized runs).
"""

import dataclasses

import numpy as np

from cbjax.core.request import PENDING_TOKEN, Request
from cbjax.core.scheduler_output import SchedulerOutput
from cbjax.runner.flat_input import FlatStepInput, layout_of
from cbjax.runner.step_input import BucketTable, pack_step


@dataclasses.dataclass(slots=True)
class _DecodeBatch:
    """The last packed step, when every one of its sequences was a plain decode (slot i = out.seqs[i]), or a block
    of them."""

    inp: FlatStepInput
    order: list[int]  # 0..n-1
    requests: list[Request]
    computed: list[int]  # each slot's num_computed_tokens in that step
    page_lists: list[list[int]]  # each request's page list then (the list object: the scheduler may replace it)
    num_pages: list[int]
    num_dropped: list[int]
    # The decode steps every slot ran (1, or the block's length); 0 when the slots of a block ran different numbers
    # of steps: a slot that ran fewer has finished, so the next step is never this batch moved on.
    ran: int
    tokens_pending: bool  # every input token was the previous step's pending sample (token_src[:n] = 0..n-1)


class StepPacker:
    """Packs every dispatched step of one runner (it keeps the last step's input and slots)."""

    def __init__(self, buckets: BucketTable, pad_page: int):
        self.buckets, self.pad_page = buckets, pad_page
        # Each request's slot in the last packed step, for the requests that sampled a token there: the next
        # step reads their pending tokens from that step's output.
        self.prev_slot_of: dict[Request, int] = {}
        self._last: _DecodeBatch | None = None
        self._delta: tuple[object, int, np.ndarray] | None = None  # (layout, n, the advancing vector)
        self.num_advanced = 0  # steps packed by advancing the previous one (for tests and profiles)

    def pack(self, out: SchedulerOutput, verify: bool = False) -> tuple[FlatStepInput, list[int]]:
        """The step's input and `order` (slot i holds out.seqs[order[i]]), as pack_step returns them."""
        last, self._last = self._last, None
        advanced = None if last is None or verify else self._advance(out, last)
        if advanced is not None:
            self.num_advanced += 1
            self._last = advanced
            return advanced.inp, advanced.order  # (the slots are the last step's: prev_slot_of holds)
        inp, order = pack_step(out, self.buckets, self.pad_page, self.prev_slot_of, verify)
        flat = layout_of(inp).flatten(inp)
        seqs = out.seqs
        self.prev_slot_of = {seqs[j].request: i for i, j in enumerate(order) if seqs[j].samples_token}
        n = len(seqs)
        if not verify and out.num_batched_tokens == n and len(self.prev_slot_of) == n:
            reqs = [s.request for s in seqs]  # all decodes, so order is 0..n-1
            pages = [r.pages for r in reqs]
            self._last = _DecodeBatch(
                flat,
                order,
                reqs,
                [s.num_computed_tokens for s in seqs],
                pages,
                [len(p) for p in pages],
                [r.num_dropped_pages for r in reqs],
                _steps_run(out),
                tokens_pending=False,  # (pack_step's token_src holds the slots of the step before)
            )
        return flat, order

    def _advance(self, out: SchedulerOutput, last: _DecodeBatch) -> _DecodeBatch | None:
        """`out` as the last step moved on by the steps it ran, or None if it is not that (then it is packed from
        scratch)."""
        seqs, reqs = out.seqs, last.requests
        n, blocks, ran = len(seqs), out.num_steps > 1, last.ran
        if n != len(reqs) or out.num_batched_tokens != n or blocks != last.inp.layout.blocks or not ran:
            return None  # (a block and a single step are inputs of different programs; `ran` 0: _DecodeBatch.ran)
        G = self.buckets.page_size
        computed, page_lists, num_pages, num_dropped = last.computed, last.page_lists, last.num_pages, last.num_dropped
        new_computed, tokens, new_page, changed_rows = [], [], [], []
        for i, s in enumerate(seqs):
            r = s.request
            c = s.num_computed_tokens
            # The same request in the same slot, as many decode tokens further as it ran, sampling (a decode's
            # chunk always reaches the end of its context), with no drafts.
            if r is not reqs[i] or c != computed[i] + ran or s.num_new_tokens != 1 or not s.samples_token:
                return None
            if s.draft_token_ids:
                return None
            new_computed.append(c)
            tokens.append(r.all_token_ids[c])
            pages = r.pages
            if pages is not page_lists[i] or len(pages) != num_pages[i] or r.num_dropped_pages != num_dropped[i]:
                changed_rows.append(i)
            if c // G != (c - ran) // G:  # position c is in another page: its slot is not the last one + ran
                new_page.append((i, pages[c // G - r.num_dropped_pages] * G + c % G))
        layout = last.inp.layout
        off = layout.offsets
        ints = last.inp.ints + self._advancing_vector(layout, n, ran)
        sm = off["slot_mapping"]
        for i, slot in new_page:
            ints[sm + i] = slot
        if changed_rows:
            page_lists, num_pages, num_dropped = list(page_lists), list(num_pages), list(num_dropped)
            W = layout.W
            for i in changed_rows:
                r = reqs[i]
                first, k, row = r.num_dropped_pages, len(r.pages), off["page_indices"] + i * W
                ints[row : row + W] = self.pad_page
                ints[row + first : row + first + k] = r.pages
                page_lists[i], num_pages[i], num_dropped[i] = r.pages, k, first
        if blocks:
            at = off["decode_steps"]
            ints[at : at + n] = [s.num_steps for s in seqs]
        pending = tokens.count(PENDING_TOKEN) == n
        if not (pending and last.tokens_pending):
            ids, src = off["token_ids"], off["token_src"]
            known = np.asarray(tokens, np.int32)
            is_pending = known == PENDING_TOKEN
            ints[ids : ids + n] = np.where(is_pending, 0, known)
            ints[src : src + n] = np.where(is_pending, np.arange(n, dtype=np.int32), -1)  # last step's slot i: i
        inp = FlatStepInput(ints, last.inp.floats, layout)
        steps = _steps_run(out) if blocks else 1  # (single steps: always 1, no pass over the sequences)
        return _DecodeBatch(inp, last.order, reqs, new_computed, page_lists, num_pages, num_dropped, steps, pending)

    def _advancing_vector(self, layout, n: int, k: int) -> np.ndarray:
        """+k at every slot's position, context length, slot mapping and sampling counter (for slots < n)."""
        if self._delta is None or self._delta[:2] != (layout, n):
            delta = np.zeros(layout.num_ints, np.int32)
            for name in ("positions", "slot_mapping", "kv_lens", "counters"):
                at = layout.offsets[name]
                delta[at : at + n] = 1
            self._delta = (layout, n, delta)
        return self._delta[2] if k == 1 else self._delta[2] * k


def _steps_run(out: SchedulerOutput) -> int:
    """The decode steps every sequence of `out` runs, or 0 when they differ (see _DecodeBatch.ran)."""
    k = out.num_steps
    return k if all(s.num_steps == k for s in out.seqs) else 0
