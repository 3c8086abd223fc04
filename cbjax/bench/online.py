"""The online loop: requests join a running engine when the clock reaches their arrival time.

`run_online(engine, workload)` replays a workload (cbjax.bench.workload: requests with arrival times in seconds from the
start of the run) against one engine and returns per-request and per-step records (cbjax.bench.metrics). Between steps
it hands every request that has arrived to the engine (or to the client-side batcher, see `ClientBatching`); when
nothing can run, it jumps (virtual clock) or sleeps (real clock) to the next event: an arrival, a client window
closing, or a static batch's timeout.

A policy-list entry (any engine policy of cbjax.core.policy_zoo.POLICIES, or "time_window") is turned into engine
options plus client behaviour by `plan_policy`, so every baseline runs on the same runner and the same model.

`horizon_s` ends a run at that time (seconds from its start): what is still in flight is aborted and counts as not
completed, which is how a starving policy shows in the completion rates.

Multi-turn sessions run closed-loop: a turn arrives only after the previous one finished (cbjax/bench/sessions.py).

Clocks: the engine's own clock is used. With a `cbjax.core.VirtualClock` the loop never sleeps; each step moves
the clock by `step_cost_s` (fixed: reproducible tests) or by the step's measured wall time (None). The move happens
inside the step (the engine's `after_execute` hook), after the model ran and before the scheduler stamps the
sampled tokens, so a token's time is the end of the step that produced it, as on a real clock. The simulator's
runner (cbjax.sim, `runner="sim"`) moves the clock itself, by its cost model's step time, at the same point.

Ctrl-C (KeyboardInterrupt) ends the run cleanly: requests that had arrived but not finished are aborted and the
records measured so far are returned, with `interrupted=True`.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from cbjax.bench.metrics import RequestRecord, StepRecord
from cbjax.bench.requests import WorkloadRequest
from cbjax.bench.run_gc import run_objects_only
from cbjax.bench.sessions import Arrivals
from cbjax.core.clock import VirtualClock
from cbjax.core.outputs import RequestOutput
from cbjax.core.policy_zoo import POLICIES
from cbjax.core.sampling_params import SamplingParams

_log = logging.getLogger(__name__)

__all__ = ["POLICY_NAMES", "ClientBatching", "OnlineResult", "PolicyPlan", "Progress", "plan_policy", "run_online"]


@dataclasses.dataclass(frozen=True)
class ClientBatching:
    """Client-side batching: hold arrivals until `window_s` has passed since the first one held, or until
    `max_batch` are held, then submit them together."""

    window_s: float
    max_batch: int

    def __post_init__(self):
        if self.window_s < 0:
            raise ValueError(f"time_window.window_ms must be >= 0, got {self.window_s * 1e3}")
        if self.max_batch < 1:
            raise ValueError(f"time_window.max_batch must be >= 1, got {self.max_batch}")


@dataclasses.dataclass(frozen=True)
class PolicyPlan:
    """How one policy-list entry runs: engine options (override the experiment's engine config) and the client."""

    name: str
    engine_options: dict[str, Any]
    client: ClientBatching | None = None


POLICY_NAMES = (*POLICIES, "time_window")


def plan_policy(
    name: str,
    *,
    static_batch_timeout_s: float = 0.0,
    window_ms: float = 0.0,
    max_batch: int = 1,
    policy_options: dict | None = None,
) -> PolicyPlan:
    """The one table from a policy-list entry to (engine options, client behaviour).

    static:      server-side static batching: the engine starts a batch when max_num_seqs requests wait or the
                 oldest has waited `static_batch_timeout_s`, and admits nothing new until the batch is done.
    time_window: client-side batching: the client holds arrivals for `window_ms` or `max_batch` requests, then
                 submits them together to a static engine that starts whatever is waiting (timeout 0).
    any other engine policy (fcfs, sarathi, priority, ...): every arrival goes straight to the engine, which runs
                 that policy with `policy_options`.
    """
    if name == "time_window":
        return PolicyPlan(
            name,
            dict(policy="static", static_batch_timeout_s=0.0),
            ClientBatching(float(window_ms) / 1e3, int(max_batch)),
        )
    if name == "static":
        return PolicyPlan(name, dict(policy="static", static_batch_timeout_s=float(static_batch_timeout_s)))
    if name not in POLICIES:
        raise ValueError(f"unknown policy entry {name!r}; known: {list(POLICY_NAMES)}")
    options = dict(policy=name, static_batch_timeout_s=0.0)
    if policy_options:
        options["policy_options"] = dict(policy_options)
    return PolicyPlan(name, options)


@dataclasses.dataclass
class OnlineResult:
    """What one run measured. Times in the records are seconds from the start of the run (the workload's clock)."""

    requests: list[RequestRecord]
    steps: list[StepRecord]
    interrupted: bool = False
    # requests whose arrival time had not come when the run was interrupted; sessions' turns never sent (sessions.py)
    num_not_arrived: int = 0
    wall_s: float = 0.0  # real seconds the loop ran (on a virtual clock: how long the simulation took)
    # request id -> generated token ids, for completed requests (checks that policies agree on the outputs)
    output_token_ids: dict[str, list[int]] = dataclasses.field(default_factory=dict)


class Progress(NamedTuple):
    """Handed to `on_step` after every engine step (a named tuple: made once per step, a third of a frozen
    dataclass's cost)."""

    num_steps: int
    num_submitted: int  # handed to the engine (refused ones included), so not held by the client batcher
    num_finished: int  # finished, aborted or refused


def _params(req: WorkloadRequest) -> SamplingParams:
    # Greedy and EOS ignored: every policy generates exactly max_tokens for each request, so throughput compares
    # the same work whatever the random model would have emitted.
    return _params_of(int(req.max_tokens))


@functools.lru_cache(maxsize=4096)
def _params_of(max_tokens: int) -> SamplingParams:
    # SamplingParams are frozen, so requests of one length share one: building (and validating) one per request
    # was ~3% of a simulated run.
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


class _OnlineRun:
    """The state of one run_online call: what is yet to arrive, held by the client, in the engine, finished."""

    def __init__(
        self,
        engine,
        workload: Sequence[WorkloadRequest],
        client: ClientBatching | None,
        step_cost_s: float | None,
        on_step: Callable[[Progress], None] | None,
        horizon_s: float | None = None,
    ):
        self.engine = engine
        # Each request's output is read once it finished (an interrupted run aborts the rest, which finishes them).
        engine.stream_outputs = False
        self.clock = engine.clock
        self.virtual = isinstance(self.clock, VirtualClock)
        if step_cost_s is not None and not self.virtual:
            raise ValueError("step_cost_s needs an engine on a VirtualClock")
        if step_cost_s is not None and step_cost_s <= 0:
            raise ValueError(f"step_cost_s must be > 0, got {step_cost_s}")
        self.step_cost_s = step_cost_s
        if horizon_s is not None and not horizon_s > 0:
            raise ValueError(f"horizon_s must be > 0 or None, got {horizon_s}")
        self.horizon_s = horizon_s
        self.client = client
        self.on_step = on_step
        # What is yet to arrive; a multi-turn session's later turns arrive only once the turn before has finished.
        self.pending = Arrivals(workload)
        self.by_id = {r.request_id: r for r in workload}
        if len(self.by_id) != len(workload):
            raise ValueError("workload request ids must be unique")
        self.held: list[WorkloadRequest] = []  # arrived, held by the client batcher
        self.submitted: dict[str, RequestOutput | None] = {}  # request id -> latest output seen
        self.refused: dict[str, float] = {}  # request id -> when it was refused or dropped (never ran)
        self.finished: dict[str, RequestOutput] = {}
        self.num_steps = 0
        self.t0 = 0.0
        self.step_started = 0.0

    # ---- time ---------------------------------------------------------------------------------------------------
    def advance_virtual_clock(self) -> None:
        """The engine's `after_execute` hook on a virtual clock: the model ran, the tokens are not stamped yet."""
        self.clock.advance(
            self.step_cost_s if self.step_cost_s is not None else time.perf_counter() - self.step_started
        )

    def now(self) -> float:
        """Seconds since the start of the run."""
        return self.clock.now() - self.t0

    def wait_until(self, t: float) -> None:
        if self.virtual:
            target = self.t0 + t
            # With t0 > 0 (an engine reused for another run), t0 + t - t0 can round below t: the arrival would
            # never be due and the loop would wait for it forever.
            while target - self.t0 < t:
                target = math.nextafter(target, math.inf)
            self.clock.set(max(self.clock.now(), target))
        else:
            delay = self.t0 + t - self.clock.now()
            if delay > 0:
                time.sleep(delay)

    def next_event(self) -> float | None:
        """When something can next change while nothing runs: an arrival, the client window, a static timeout."""
        times = []
        if self.pending.next_time() is not None:
            times.append(self.pending.next_time())
        if self.held:
            times.append(self.held[0].arrival_time + self.client.window_s)
        policy_time = self.engine.next_event_time()
        if policy_time is not None:
            times.append(policy_time - self.t0)
        if times and self.horizon_s is not None:
            times.append(self.horizon_s)
        return min(times) if times else None

    # ---- arrivals -----------------------------------------------------------------------------------------------
    def admit_arrivals(self) -> None:
        now = self.now()
        while (req := self.pending.pop_due(now)) is not None:
            if self.client is None:
                self.submit([req])
            else:
                self.held.append(req)
                if len(self.held) >= self.client.max_batch:
                    self.submit(self.held[: self.client.max_batch])
                    del self.held[: self.client.max_batch]
        if self.held and now >= self.held[0].arrival_time + self.client.window_s:
            self.submit(self.held)
            self.held = []

    def submit(self, reqs: Sequence[WorkloadRequest]) -> None:
        for r in reqs:
            self.by_id[r.request_id] = r  # a session's later turn: as released, its prompt built then
            try:
                # The nominal arrival time: a request that arrived during a step waited in the server's queue,
                # and one held by the client batcher waited at the client; both waits count in its TTFT.
                self.engine.add_request(
                    r.request_id,
                    r.prompt_token_ids,  # (add_request copies it)
                    _params(r),
                    arrival_time=self.t0 + r.arrival_time,
                    priority=r.priority,
                    tenant=r.tenant,
                    deadline=None if r.deadline is None else self.t0 + r.deadline,
                )
                self.submitted[r.request_id] = None
            except ValueError:
                # The engine says why (too long for the pool, ...); the record counts it as aborted, as vLLM does.
                self.refused[r.request_id] = self.now()
                self.pending.finished(r, None, self.t0)

    # ---- the loop -----------------------------------------------------------------------------------------------
    def step(self) -> bool:
        """One engine step; False when nothing ran (a static batch is still waiting to fill). A call that took a row
        of a streaming block (LLMEngine.stream_rows) dispatched nothing and, final outputs only, may return nothing:
        it ran all the same (the block goes on; the next call takes its next row)."""
        engine = self.engine
        steps_before, rows_before = engine.num_steps, engine.num_rows_received
        self.step_started = time.perf_counter()
        outputs = engine.step()
        for out in outputs:
            self.submitted[out.request_id] = out
            if out.finished:
                self.finished[out.request_id] = out
                self.pending.finished(self.by_id[out.request_id], out, self.t0)  # a session's next turn
        dispatched = engine.num_steps > steps_before
        if dispatched:
            self.num_steps += 1
            if self.on_step is not None:
                self.on_step(
                    Progress(
                        self.num_steps, len(self.submitted) + len(self.refused), len(self.finished) + len(self.refused)
                    )
                )
        return dispatched or bool(outputs) or engine.num_rows_received > rows_before

    def loop(self) -> None:
        """Run until every request has finished, or until the horizon (then returns True)."""
        while True:
            if self.horizon_s is not None and self.now() >= self.horizon_s:
                return True
            self.admit_arrivals()
            if self.engine.has_unfinished_requests():
                if self.step():
                    continue
            elif not self.pending and not self.held:
                return False
            wake = self.next_event()
            if wake is None:
                raise RuntimeError("online loop stalled: requests wait but no arrival or timeout can start them")
            if wake <= self.now():
                # Float rounding can leave a timeout a hair short of due; nudge past it instead of spinning.
                wake = self.now() + 1e-6
            self.wait_until(wake)

    def abort_rest(self) -> None:
        """After an interrupt or at the horizon: abort what the engine still holds and collect the abort outputs."""
        for r in self.held:
            self.refused[r.request_id] = self.now()
        self.held = []
        try:
            self.engine.abort_all()
            for out in self.engine.step():  # the scheduler is empty now: this only reports the aborts
                self.submitted[out.request_id] = out
                if out.finished:
                    self.finished[out.request_id] = out
        except Exception as e:  # the interrupt may have hit mid-step; keep what was measured regardless
            _log.warning("aborting after the interrupt failed (%s); unfinished requests are recorded as aborted", e)

    # ---- records ------------------------------------------------------------------------------------------------
    def request_records(self) -> list[RequestRecord]:
        records = []
        for rid, out in self.submitted.items():
            records.append(self._record(self.by_id[rid], out))
        for rid, end in self.refused.items():
            r = self.by_id[rid]
            records.append(
                RequestRecord(
                    rid,
                    r.prompt_len,
                    0,
                    r.arrival_time,
                    finished_time=end,
                    finish_reason="abort",
                    length_class=r.length_class,
                    tenant=r.tenant,
                    turn=r.turn,
                )
            )
        records.sort(key=lambda rec: (rec.arrival_time, rec.request_id))
        return records

    def _record(self, req: WorkloadRequest, out: RequestOutput | None) -> RequestRecord:
        if out is None:  # submitted, never produced an output before an interrupt that also broke the abort
            return RequestRecord(
                req.request_id,
                req.prompt_len,
                0,
                req.arrival_time,
                finish_reason="abort",
                length_class=req.length_class,
                tenant=req.tenant,
                turn=req.turn,
            )
        m = out.metrics
        comp = out.outputs[0]
        reason = comp.finish_reason if out.finished else "abort"
        n = len(comp.token_ids)
        # t - 0.0 == t for every float: a run that starts at time 0 (a fresh engine's clock) copies the list.
        token_times = list(m.token_times) if self.t0 == 0 else [t - self.t0 for t in m.token_times]
        if len(token_times) != n:  # only after an interrupt inside a step's update
            token_times = []

        def rel(t):
            return None if t is None else t - self.t0

        return RequestRecord(
            req.request_id,
            req.prompt_len,
            n,
            m.arrival_time - self.t0,
            first_scheduled_time=rel(m.first_scheduled_time),
            first_token_time=rel(m.first_token_time),
            token_times=token_times,
            finished_time=rel(m.finished_time),
            finish_reason=reason,
            length_class=req.length_class,
            tenant=req.tenant,
            num_preemptions=m.num_preemptions,
            turn=req.turn,
        )


def run_online(
    engine,
    workload: Sequence[WorkloadRequest],
    *,
    client: ClientBatching | None = None,
    step_cost_s: float | None = None,
    on_step: Callable[[Progress], None] | None = None,
    horizon_s: float | None = None,
) -> OnlineResult:
    """Replay `workload` against `engine` by arrival time; returns the measured records.

    `engine` is an LLMEngine (warmed up, so compiles stay out of the timings) on a real or virtual clock.
    `client` batches arrivals on the client side (the time_window baseline). `step_cost_s` (virtual clock only)
    is the fixed cost of every step; None measures each step's wall time. `on_step` is called after every step.
    Ctrl-C stops the run, aborts the requests in flight and returns what was measured, `interrupted=True`.
    `horizon_s` ends the run at that time the same way, but as a normal end (`interrupted=False`,
    `num_not_arrived` counts the requests whose arrival it cut off).
    """
    run = _OnlineRun(engine, workload, client, step_cost_s, on_step, horizon_s)
    first_step = len(engine.step_records)
    simulated = engine.advances_clock  # the simulator's runner moves the clock itself
    if simulated and step_cost_s is not None:
        raise ValueError("step_cost_s is for the real runner; the simulator's step times come from its cost model")
    if run.virtual and not simulated:
        engine.after_execute = run.advance_virtual_clock
    run.t0 = engine.clock.now()
    wall0 = time.perf_counter()
    interrupted = cut = False
    with run_objects_only(pause=simulated) as frozen:  # (run_gc.py: the collector, frozen and paused)
        try:
            cut = run.loop()
            if cut:
                run.abort_rest()
        except KeyboardInterrupt:
            interrupted = True
            run.abort_rest()
        finally:
            engine.after_execute = None
        if frozen:
            gc.freeze()  # and what the run made: the records' collections walk only the records
        steps = [StepRecord.from_engine(s, run.t0) for s in engine.step_records[first_step:]]
        outputs = {
            rid: list(out.outputs[0].token_ids)
            for rid, out in run.finished.items()
            if out.outputs[0].finish_reason in ("stop", "length")
        }
        return OnlineResult(
            run.request_records(),
            steps,
            interrupted,
            (len(run.pending) if interrupted or cut else 0) + run.pending.num_dropped,
            time.perf_counter() - wall0,
            outputs,
        )
