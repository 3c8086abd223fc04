"""TokenStream: each step of a block of decode steps hands its tokens to the host as it ends, so that a streaming
engine returns one token per request per step() although the device runs the block in one dispatch.

Why: a block of N steps (core/multi_step.py, runner/decode_loop.py) pays the host's schedule, pack and launch once
per N steps; at 64 streaming sequences of llama-tiny that work was ~1.1 ms of each ~14 ms step on 2 cores, and the
program call alone ~0.3 ms of it (jax's dispatch, measured with the device idle). But a block's tokens used to
reach the host together at its end: N tokens at once for a streaming client. Here the device loop writes each
step's row into a ring in host memory (kernels_pallas/cpu/token_stream.cc: a memcpy and a futex wake), and the
engine takes the rows one per LLMEngine.step() call, waiting with the GIL released.

CPU only (the ring is host memory the device's loop writes directly): None from `TokenStream.create` elsewhere, on a
mesh, or without the CPU kernel library; blocks then deliver their rows at their end as before. A request that
arrives during a streaming block need not wait for the block's end: the engine asks the block to end after the
step it is running (`request_stop`: the device loop reads a stop word after each step, decode_loop.py), learns
how many steps ran (`steps_run`) and gives the others back (core/multi_step.py `shorten_block`).
"""

import ctypes
import itertools
import time
import weakref

import numpy as np

_positions = itertools.count()  # one counter for every stream of the process (see TokenStream.reserve)
_FREE_RINGS: dict[tuple[int, int], list[np.ndarray]] = {}  # (cap, width): rings of dropped streams
TAKE_TIMEOUT_US = 20_000  # one wait's slice: between slices the caller checks that the block is still running
STOPPING_TIMEOUT_US = 200  # the slice for a block asked to end early (its next row may never come: the sooner
# the engine sees that the block ended, the less the device idles before the next step; polled at most one step)


class TokenStream:
    """A ring of `cap` rows of `width` int32 tokens in host memory (token_stream.cc says its layout), written by the
    block programs' loops, read by `take`."""

    def __init__(self, target: str, take, width: int, cap: int):
        self.target, self.width, self.cap = target, width, cap
        self._take = take
        # A ring is never freed: a block still running when its stream is dropped may write into it (so a dropped
        # stream's ring goes back to a pool for the next stream of its size: positions are unique, so a late write
        # there is never a row that stream waits for).
        free = _FREE_RINGS.setdefault((cap, width), [])
        self.ring = free.pop() if free else np.zeros(cap + cap * width + 1, np.int32)  # (+ the stop word)
        weakref.finalize(self, free.append, self.ring)
        addr = self.ring.ctypes.data
        self._addr = ctypes.c_void_p(addr)
        self._meta_head = (np.int32(np.uint32(addr & 0xFFFFFFFF)), np.int32(np.uint32(addr >> 32)))
        self._row = np.zeros(width, np.int32)
        self._row_addr = ctypes.c_void_p(self._row.ctypes.data)

    @classmethod
    def create(cls, width: int, block_steps: int) -> "TokenStream | None":
        """A stream for blocks of up to `block_steps` steps of `width` tokens, or None where it cannot run (not the
        CPU backend, or no CPU kernel library)."""
        import jax

        from kernels_pallas.cpu import library

        if jax.default_backend() != "cpu":
            return None
        found = library.token_stream()
        if found is None:
            return None
        # Rows in flight: the block being read and the one dispatched after it (the engine dispatches the next
        # block only once it has taken every row but the last of this one); 4 blocks of room.
        return cls(*found, width, 4 * block_steps)

    @staticmethod
    def off_meta() -> np.ndarray:
        """The meta of a block that does not stream (the loop's calls do nothing)."""
        return np.zeros(5, np.int32)

    def reserve(self, num_steps: int) -> tuple[int, np.ndarray]:
        """Positions for a block of `num_steps` steps: (its base, the meta its program takes). Positions are
        unique in the process (mod 2^32), so a row a dropped runner's block writes late is never one a reader
        waits for."""
        base = next(_positions)
        for _ in range(num_steps - 1):
            next(_positions)
        base %= 1 << 32
        self.ring[-1] = np.uint32((base - 1) % (1 << 32)).view(np.int32)  # (no stop asked of it: a stale one cleared)
        meta = np.array([*self._meta_head, np.uint32(base).view(np.int32), self.cap, self.width], np.int32)
        return base, meta

    def request_stop(self, handle) -> None:
        """Ask the streaming block of `handle` to end after the step it is running (token_stream.cc's stop word: its
        later rows stay -1, decode_loop.py); `steps_run` says where it ended. For a request that arrived: it should
        not wait for the block's end to be admitted."""
        handle.stop_requested = True
        self.ring[-1] = np.uint32(handle.stream_base % (1 << 32)).view(np.int32)

    @staticmethod
    def steps_run(handle) -> int:
        """How many steps the block of `handle` ran, once it ended (waits for it: the wait counts in
        `handle.row_wait_s`)."""
        t0 = time.perf_counter()
        rows = np.asarray(handle.tokens)
        handle.row_wait_s += time.perf_counter() - t0
        return int((rows[:, 0] >= 0).sum())

    def next_row(self, handle) -> list[int] | None:
        """ModelRunner.fetch_row for the block of `handle` (a runner StepHandle with a `stream_base`): the next
        row's tokens in out.seqs order, as ints (the scheduler applies them one by one)."""
        t0, j = time.perf_counter(), handle.rows_received
        if j == 0:  # once per block: how a row's slots map to out.seqs (a decode block's is usually the identity)
            order = np.asarray(handle.order)
            handle.row_order = None if (order == np.arange(order.size)).all() else np.argsort(order)
        # (a block asked to stop may end without this row: then check for its end every 0.2 ms)
        slice_us = STOPPING_TIMEOUT_US if handle.stop_requested else TAKE_TIMEOUT_US
        row = self.take(handle.stream_base + j, len(handle.order), handle.tokens.is_ready, slice_us)
        handle.row_wait_s += time.perf_counter() - t0
        if row is None:
            handle.stream_base = None
            return None
        handle.rows_received = j + 1
        return row.tolist() if handle.row_order is None else row[handle.row_order].tolist()

    def take(self, pos: int, n: int, done, slice_us: int = 0) -> np.ndarray | None:
        """The first `n` tokens of position `pos` once its step has run (a view, valid until the next take), or
        None when `done()` says the block ended without it (a failed program) or the row was lost."""
        take, ring, row = self._take, self._addr, self._row_addr
        pos %= 1 << 32
        while True:
            got = take(ring, self.cap, self.width, pos, row, n, slice_us or TAKE_TIMEOUT_US)
            if got == 1:
                return self._row[:n]
            if got < 0 or done():
                got = take(ring, self.cap, self.width, pos, row, n, 0)  # (written just before the block ended)
                return self._row[:n] if got == 1 else None
