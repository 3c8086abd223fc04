"""The one thread that owns the engine, and the thread-safe boundary the HTTP side talks to it through.

The engine is not thread-safe, so only this thread calls `add_request`, `step` and `abort_request`. The event loop
of the HTTP server enqueues commands (`submit`, `abort`) on a `queue.SimpleQueue`; the thread takes them between
steps and, when no request is unfinished, blocks on that queue (no busy spin). Each request's events go to its
own `asyncio.Queue` as soon as the step that made them has ended: a step's token events go over together, in one
`loop.call_soon_threadsafe` per event loop (each call wakes the loop through a write to its self-pipe: one per
streaming request per step was the serving thread's largest cost per token after the step itself):

  ("accepted", None)                    the engine took the request
  ("rejected", message)                 the engine refused it (its ValueError's message: a 400)
  ("tokens", deltas, final)             a step's deltas, one per sample that changed (n > 1: several), each a
                                        ChoiceDelta; final: None, or on the last event the request's outputs
  ("error", status, message)            aborted by the server (timeout: 408, shutdown: 503)

Admission is bounded: requests accepted and not yet running (queued commands + the scheduler's waiting queue), less
the slots free at the last look, are at most `max_waiting`; beyond that `submit` raises QueueFull (a 429 with
Retry-After).
"""

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import queue
import threading
import time
from typing import NamedTuple

from cbjax.core.outputs import ReceivedOutput
from cbjax.core.sampling_params import SamplingParams
from cbjax.engine import LLMEngine
from cbjax.serve.metrics import ServerMetrics

log = logging.getLogger("cbjax.serve")


class QueueFull(Exception):
    pass


class ShuttingDown(Exception):
    pass


class ChoiceDelta(NamedTuple):
    """One sample's change in one step. `text` is the engine's visible text so far for requests with stop strings
    (cbjax/stop_strings.py), else None (the server decodes the tokens itself); `logprobs` the new tokens' entries
    when the request asked for logprobs, else None."""

    index: int
    new_ids: list[int]
    finish_reason: str | None
    text: str | None
    logprobs: list | None


@dataclasses.dataclass(eq=False)
class RequestHandle:
    """The HTTP side's end of one request. Only the loop thread writes the timing fields."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    priority: int
    tenant: str
    deadline_s: float | None  # relative to arrival (the edf policy)
    events: asyncio.Queue
    aloop: asyncio.AbstractEventLoop
    arrival: float = dataclasses.field(default_factory=time.monotonic)
    timeout_at: float | None = None
    last_token: float | None = None
    num_tokens: int = 0
    closed: bool = False  # no more events: finished, aborted or refused


class EngineLoop:
    """Owns `engine` on a background thread. `submit`/`abort` are called from the HTTP server's event loop."""

    def __init__(
        self,
        engine: LLMEngine,
        metrics: ServerMetrics,
        *,
        max_waiting: int = 1024,
        request_timeout_s: float | None = None,
    ):
        self.engine = engine
        self.metrics = metrics
        self.max_waiting = max_waiting
        self.request_timeout_s = request_timeout_s or None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._pending_adds = 0  # submitted, not yet taken by the loop thread (guarded by _lock)
        self._num_waiting = 0  # the scheduler's waiting queue after the last command batch (guarded by _lock)
        self._free_slots = engine.config.scheduler.max_num_seqs  # slots not running a request, then (guarded by _lock)
        self._live: dict[str, RequestHandle] = {}  # loop thread only
        self._ids = itertools.count()
        self.accepting = True
        self.shutting_down = False
        self.drained: list[str] = []  # finished normally after shutdown began
        self.aborted_at_shutdown: list[str] = []
        self.error: BaseException | None = None  # what killed the loop thread, if anything
        self._thread = threading.Thread(target=self._run, name="cbjax-engine-loop", daemon=True)
        metrics.pages_total.set(engine.scheduler.pool.num_pages)

    # ---- the HTTP side (event loop thread) --------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        tenant: str = "default",
        deadline_s: float | None = None,
    ) -> RequestHandle:
        """Queue a request for the engine; its events arrive on the returned handle's `events`. Raises QueueFull or
        ShuttingDown. Must be called from a running event loop (the one that reads the events)."""
        if not self.accepting or not self.alive:
            raise ShuttingDown("the server is shutting down")
        with self._lock:
            # Those that would wait: beyond the free slots (a burst into an idle server is not a queue).
            if self._pending_adds + self._num_waiting - self._free_slots >= self.max_waiting:
                raise QueueFull(f"the waiting queue is full ({self.max_waiting} requests)")
            self._pending_adds += 1
        h = RequestHandle(
            f"req-{next(self._ids)}",
            prompt_ids,
            params,
            priority,
            tenant,
            deadline_s,
            asyncio.Queue(),
            asyncio.get_running_loop(),
        )
        if self.request_timeout_s is not None:
            h.timeout_at = h.arrival + self.request_timeout_s
        self._commands.put(("add", h))
        return h

    def abort(self, handle: RequestHandle) -> None:
        """Abort a request (client gone); its pages are freed by the next step."""
        self._commands.put(("abort", handle))

    def num_unfinished(self) -> int:
        return len(self._live) + self._pending_adds

    def begin_shutdown(self) -> None:
        """Refuse new requests from now on; the ones in flight go on (drain)."""
        self.accepting = False
        self.shutting_down = True

    def abort_all(self, reason: str) -> None:
        self._commands.put(("abort_all", reason))

    def stop(self, timeout: float = 10.0) -> None:
        """Abort whatever is left and end the thread."""
        self.accepting = False
        self._commands.put(("stop", None))
        self._thread.join(timeout)

    # ---- the loop thread --------------------------------------------------------------------------------------
    def _send(self, h: RequestHandle, event: tuple) -> None:
        with contextlib.suppress(RuntimeError):  # RuntimeError: that event loop is closed, nobody listens any more
            h.aloop.call_soon_threadsafe(h.events.put_nowait, event)

    def _send_all(self, batch: list[tuple[RequestHandle, tuple]]) -> None:
        """Send a step's events, in order: one call per event loop that has any (a server has one)."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for item in batch:
            by_loop.setdefault(item[0].aloop, []).append(item)
        for aloop, items in by_loop.items():
            with contextlib.suppress(RuntimeError):  # (as in _send)
                aloop.call_soon_threadsafe(_put_all, items)

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # the engine broke: tell every waiting client, then stop
            log.exception("engine loop failed")
            self.error = e
            self.accepting = False
            for h in list(self._live.values()):
                self._close(h, ("error", 500, f"engine failure: {e!r}"), "error")
            raise

    def _loop(self) -> None:
        engine = self.engine
        while True:
            idle = not self._live and not engine.has_unfinished_requests()
            commands = []
            try:
                # Nothing to step: sleep until a command comes.
                commands.append(self._commands.get(block=idle))
                while True:
                    commands.append(self._commands.get_nowait())
            except queue.Empty:
                pass
            stop = False
            for cmd, arg in commands:
                if cmd == "add":
                    self._add(arg)
                elif cmd == "abort":
                    self._abort(arg, None)
                elif cmd == "abort_all":
                    for h in list(self._live.values()):
                        self._abort(h, ("error", 503, f"aborted: {arg}"))
                        self.aborted_at_shutdown.append(h.request_id)
                elif cmd == "stop":
                    stop = True
            if stop:
                for h in list(self._live.values()):
                    self._abort(h, ("error", 503, "aborted: the server stopped"))
                    self.aborted_at_shutdown.append(h.request_id)
                while engine.has_unfinished_requests():  # let the aborts reach the pool
                    engine.step()
                self._publish()
                return
            if engine.has_unfinished_requests():
                now, batch, live = time.monotonic(), [], self._live
                step = engine.step_deltas()  # (plain requests' one new token in bulk: no object per token)
                for rid, token in zip(step.request_ids, step.token_ids):
                    h = live.get(rid)
                    if h is not None:
                        self._deliver_token(h, token, now, batch)
                for out in step.outputs:
                    h = live.get(out.request_id)
                    if h is not None:
                        self._deliver(h, out, now, batch)
                if batch:
                    self._send_all(batch)
                # The engine keeps a record per step for offline metrics; a server that runs for days must not.
                engine.step_records.clear()
            self._expire(time.monotonic())
            self._publish()

    def _add(self, h: RequestHandle) -> None:
        engine = self.engine
        deadline = None if h.deadline_s is None else engine.clock.now() + h.deadline_s
        try:
            engine.add_request(
                h.request_id, h.prompt_ids, h.params, priority=h.priority, tenant=h.tenant, deadline=deadline
            )
        except ValueError as e:
            h.closed = True  # the HTTP side answers 400 and counts it
            self._send(h, ("rejected", str(e)))
        else:
            self._live[h.request_id] = h
            self.metrics.prompt_tokens.inc(len(h.prompt_ids))
            self._send(h, ("accepted", None))
        with self._lock:
            self._pending_adds -= 1
            self._num_waiting = len(engine.scheduler.waiting)
            self._free_slots = max(0, engine.config.scheduler.max_num_seqs - len(engine.scheduler.running))

    def _abort(self, h: RequestHandle, event: tuple | None) -> None:
        if h.closed or self._live.get(h.request_id) is not h:
            return
        with contextlib.suppress(ValueError):  # ValueError: it finished in the step that just ran, nothing to free
            self.engine.abort_request(h.request_id)
        self._close(h, event, "abort")

    def _close(self, h: RequestHandle, event: tuple | None, reason: str) -> None:
        h.closed = True
        self._live.pop(h.request_id, None)
        self.metrics.finished(reason)
        if self.shutting_down and reason != "abort":
            self.drained.append(h.request_id)
        if event is not None:
            self._send(h, event)

    def _deliver(self, h: RequestHandle, out, now: float, batch: list) -> None:
        """Account one output's deltas and queue its event on `batch` (closing the request when it is the last)."""
        m, p = self.metrics, h.params
        with_text, with_logprobs = bool(p.stop), p.logprobs is not None
        deltas, n = [], 0
        if isinstance(out, ReceivedOutput):  # one plain completion: its delta read without building its object
            completions, last_reason = [(0, out.stream_delta(), out.finish_reason, None)], out.finish_reason
        else:  # (a completion's new_token_ids: the view's own list, read by nobody else)
            completions = [(c.index, c.new_token_ids, c.finish_reason, c) for c in out.outputs]
            last_reason = out.outputs[0].finish_reason if out.outputs else "abort"
        for index, new, reason, c in completions:
            if not new and reason is None:
                continue
            n = max(n, len(new))  # tokens per sample this step (the samples advance together)
            if new:
                m.generation_tokens.inc(len(new))
            lp = None
            if with_logprobs and c is not None and c.logprobs is not None:
                lp = c.logprobs[len(c.logprobs) - len(new) :] if new else []
            deltas.append(ChoiceDelta(index, new, reason, c.text if with_text and c is not None else None, lp))
        if n:
            self._count_tokens(h, n, now)
        if out.finished:
            m.e2e.observe(now - h.arrival)
            self._close(h, None, last_reason)
        # The last event carries the final outputs (views of a finished request: they change no more).
        batch.append((h, ("tokens", deltas, out.outputs if out.finished else None)))

    def _deliver_token(self, h: RequestHandle, token: int, now: float, batch: list) -> None:
        """`_deliver` for a plain request's one new token, read in bulk (StepDeltas): it did not finish."""
        self.metrics.generation_tokens.inc(1)
        self._count_tokens(h, 1, now)
        batch.append((h, ("tokens", [ChoiceDelta(0, [token], None, None, None)], None)))

    def _count_tokens(self, h: RequestHandle, n: int, now: float) -> None:
        """The latency metrics of `n` new tokens of `h` (per sample) received at `now`: TTFT, else ITL each."""
        m = self.metrics
        if h.last_token is None:
            m.ttft.observe(now - h.arrival)
        else:
            for _ in range(n):
                m.itl.observe((now - h.last_token) / n)
        h.last_token = now
        h.num_tokens += n

    def _expire(self, now: float) -> None:
        for h in list(self._live.values()):
            if h.timeout_at is not None and now >= h.timeout_at:
                self._abort(h, ("error", 408, f"request timed out after {self.request_timeout_s:g} s"))
                self.metrics.rejected("timeout")

    def _publish(self) -> None:
        sched, m = self.engine.scheduler, self.metrics
        m.running.set(len(sched.running))
        m.waiting.set(len(sched.waiting) + self._pending_adds)
        m.pages_used.set(sched.pool.num_used)
        m.preemptions.set(sched.num_preemptions)
        m.steps.set(self.engine.num_steps)
        if sched.speculator is not None:
            m.spec_draft_tokens.set(sched.speculator.num_draft_tokens)
            m.spec_accepted_tokens.set(sched.speculator.num_accepted_tokens)
        with self._lock:
            self._num_waiting = len(sched.waiting)
            self._free_slots = max(0, self.engine.config.scheduler.max_num_seqs - len(sched.running))


def _put_all(items: list[tuple[RequestHandle, tuple]]) -> None:
    """On the event loop: hand each event to its request's queue."""
    for h, event in items:
        h.events.put_nowait(event)
