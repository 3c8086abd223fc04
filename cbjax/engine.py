"""LLMEngine: add requests, step, stream; one step = schedule -> dispatch -> fetch -> update.

The engine owns the request table, validates input (a bad request is refused with a ValueError and nothing else
is disturbed), and records per-step statistics for the metrics.
"""

import collections
import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager

import jax

from cbjax.bad_words import bad_word_token_ids
from cbjax.config import validation as check
from cbjax.core.clock import Clock
from cbjax.core.kv_handoff import admit_prefilled
from cbjax.core.multi_step import can_shorten_block, shorten_block
from cbjax.core.outputs import RequestOutput, StepDeltas
from cbjax.core.request import Request, RequestStatus
from cbjax.core.runner_contract import StepHandle
from cbjax.core.sampling_params import SamplingParams
from cbjax.core.sequence_group import group_problem, make_group, samples_of
from cbjax.core.speculation.speculative_blocks import receives_at_once
from cbjax.engine_build import build_engine
from cbjax.engine_config import EngineConfig
from cbjax.model.config import ModelConfig
from cbjax.model.llama import Llama
from cbjax.output_builder import OutputBuilder
from cbjax.runner.extras_runner import check_request as check_sampling_extras
from cbjax.step_record import counters_since, scheduler_counters, step_record
from cbjax.stop_strings import StopStrings
from cbjax.streamed_rows import StreamedRows
from cbjax.structured import request_constraint

# Read per token: an enum member read off its class costs ~0.1 us on Python 3.11, a global ~0.01 us.
_FINISHED = RequestStatus.FINISHED
_NOT_TIMED = contextlib.nullcontext()  # (the `timed` hooks' stand-in when no benchmark installed them)


class LLMEngine:
    """Serve many requests at once with iteration-level scheduling over a paged KV cache.

    `model` is a named config ("llama-tiny", "llama-small", "test-tiny"), a ModelConfig, a Llama instance, a Hugging
    Face checkpoint directory (config.json + safetensors [+ tokenizer.json]), a packaged model's name ("tinypy",
    "tinypy-draft"), or None for the packaged default. With a tokenizer, prompts may be text (`self.tokenizer`).
    Engine options are flat keywords (EngineConfig.option_defaults(): policy, max_num_seqs, page_size, ...), or a
    whole `config`. The engine is built by cbjax/engine_build.py, in order; `self.config` is the resolved config (its
    num_pages, num_host_pages and max_model_len set for this model and machine). `device` places the engine's
    parameters, KV pages and programs on that device (default: jax's first); a data-parallel engine
    (cbjax/data_parallel.py) gives each of its replicas one. With runner="sim" no weights are loaded and nothing is
    compiled: the same Scheduler drives a cbjax.sim.SimRunner on a VirtualClock (docs/sim.md).
    """

    def __init__(
        self,
        model: "str | ModelConfig | Llama | None" = "llama-tiny",
        *,
        config: EngineConfig | None = None,
        clock: Clock | None = None,
        device: "jax.Device | None" = None,
        cost_model=None,
        **options,
    ):
        """`config`: a whole EngineConfig (default: the defaults); `options`: flat engine options that change it.
        `cost_model` (runner="sim" only): a cbjax.sim cost model object, instead of sim_profile/sim_accelerator."""
        config = (config or EngineConfig()).replace(**options)  # every option checked before anything is built
        parts = build_engine(model, config, clock=clock, device=device, cost_model=cost_model)
        self.config = parts.config  # with the sizes resolved for this model and machine
        self.clock = parts.clock
        self.model, self.model_config, self.tokenizer = parts.model, parts.model_config, parts.tokenizer
        self.buckets, self.scheduler, self.runner = parts.buckets, parts.scheduler, parts.runner
        self.compilation_cache_dir, self.warmup_s = parts.compilation_cache_dir, parts.warmup_s
        self.requests: dict[str, Request] = {}
        self.stop_strings = StopStrings(self.tokenizer, self.scheduler)  # the requests with stop strings
        self._pending: list[Request] = []  # finished outside a step (aborts) and not yet reported
        self._adopted: list[Request] = []  # taken over by adopt_request, their first token not reported yet
        # Unfinished requests sampled with extras (cbjax/runner/extras_runner.py) -> how many of their outputs their
        # structured-output constraint has accepted.
        self._with_extras: dict[Request, int] = {}
        self.output_builder = OutputBuilder(
            self.tokenizer, self.model_config, self.stop_strings, self.requests, self._with_extras
        )
        self._arrivals = 0
        self.step_records: list[dict] = []
        self._in_flight: collections.deque = collections.deque()  # (StepHandle, its scheduler counters), oldest first
        self.num_steps = 0  # steps dispatched
        # Rows of streaming blocks taken, each by a step() call that dispatched nothing (and, with stream_outputs off,
        # may return nothing): with num_steps, how a harness tells a call that did something from an idle one.
        self.num_rows_received = 0
        self._streaming = None  # the block in flight whose rows stream (runner/token_stream.py), rows left to take
        self._rows: StreamedRows | None = None  # its rows handed out but not yet applied (streamed_rows.py)
        # Called after the model ran and before its tokens are stamped with the clock's time: a simulation moves
        # its virtual clock here, so a token's time is the end of the step that made it (cbjax.bench.online).
        self.after_execute: Callable[[], None] | None = None
        # Instrumentation: a factory of context managers, `timed(part)`, put around the step ("step") and the
        # scheduler's "schedule" and "update", and building the step's "outputs" (cbjax/bench/host_timers.py installs
        # one; the runner has its own).
        # None (the default) costs one attribute check per call.
        self.timed: Callable[[str], AbstractContextManager] | None = None
        # False: `step` returns outputs only for requests that finished (a benchmark harness that reads each
        # request's result once); True: also one per request that got a token (streaming, the default).
        self.stream_outputs = True
        # True: a block of decode steps streams its rows where the runner can, one per step(), so a request added
        # meanwhile ends it after its running step; False (LLM.generate, where nothing arrives): a block comes whole.
        self.stream_rows = True

    # ---- requests ---------------------------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: "str | Sequence[int]",
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        *,
        priority: int = 0,
        tenant: str = "default",
        deadline: float | None = None,
    ) -> None:
        """Queue a request. Raises ValueError (naming the problem) for bad input; nothing else is affected.

        `priority` (lower is more important), `tenant` and `deadline` (absolute, on the engine's clock) are read
        by the policies that use them (priority, fair_share, edf)."""
        if not isinstance(request_id, str):
            raise ValueError(f"request_id must be a string, got {request_id!r} ({type(request_id).__name__})")
        where = f"request {request_id!r}: "
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"{where}params must be SamplingParams, got {type(params).__name__}")
        if request_id in self.requests:
            raise ValueError(f"{where}duplicate request id (a request with this id is unfinished)")
        if params.num_samples > 1:  # n > 1 or best_of: a sequence group (core/sequence_group.py)
            problem = group_problem(
                params,
                self.config.scheduler.max_num_seqs,
                self.scheduler.speculator is not None,
                params.structured is not None,
            )
            if problem:
                raise ValueError(where + problem)
        mcfg, sched, cache = self.model_config, self.config.scheduler, self.config.cache
        try:
            tokens = check.prompt_token_ids(prompt, self.tokenizer, mcfg.vocab_size)
            check.token_ids("stop_token_ids", params.stop_token_ids, mcfg.vocab_size)
            priority = check.integer("priority", priority)
            tenant = check.text("tenant", tenant, empty=True)
            deadline = check.optional_real("deadline", deadline)
            arrival_time = check.optional_real("arrival_time", arrival_time)
            if params.stop and self.tokenizer is None:
                raise ValueError("stop strings need a tokenizer; this model has none (use stop_token_ids)")
            bad_word_ids = bad_word_token_ids(params.bad_words, self.tokenizer, mcfg.vocab_size)
            check_sampling_extras(
                params,
                compilation=self.config.compilation,
                vocab_size=mcfg.vocab_size,
                speculative=self.config.speculative is not None,
                simulated=self.config.sim.enabled,
            )
            total = len(tokens) + params.max_tokens
            if len(tokens) > sched.max_model_len:
                raise ValueError(f"prompt of {len(tokens)} tokens is longer than max_model_len={sched.max_model_len}")
            if total > sched.max_model_len:
                raise ValueError(
                    f"prompt ({len(tokens)}) + max_tokens ({params.max_tokens}) "
                    f"= {total} exceeds max_model_len={sched.max_model_len}"
                )
            if not self.scheduler.can_ever_fit(total):
                raise ValueError(
                    f"needs {-(-total // cache.page_size)} KV pages but the pool has only {cache.num_pages}"
                )
        except ValueError as e:
            raise ValueError(where + str(e)) from None
        if mcfg.extra_eos_token_ids and not params.ignore_eos:
            # The scheduler stops on one eos id; the checkpoint's other eos ids become stop tokens (same reason).
            params = dataclasses.replace(params, stop_token_ids=params.stop_token_ids + mcfg.extra_eos_token_ids)
        constraint = None  # compiled after every other check, so a refused request costs no grammar compile
        if params.structured is not None:
            eos_ids = [t for t in (mcfg.eos_token_id, *mcfg.extra_eos_token_ids) if t is not None]
            try:
                constraint = request_constraint(params.structured, self.tokenizer, mcfg.vocab_size, eos_ids)
            except ValueError as e:
                raise ValueError(where + str(e)) from None
        unasked_logprobs = params.num_samples > params.n and params.logprobs is None
        if unasked_logprobs:  # best_of ranks its samples by cumulative logprob: computed, not returned (vLLM)
            params = dataclasses.replace(params, logprobs=0)
        seed = params.seed if params.seed is not None else (self.config.load.seed * 1_000_003 + self._arrivals) % 2**32
        now = self.clock.now() if arrival_time is None else arrival_time
        req = Request(
            request_id, tokens, params, now, seed, self._arrivals, priority=priority, tenant=tenant, deadline=deadline
        )
        req.bad_word_ids = bad_word_ids
        req.constraint = constraint
        self._arrivals += 1
        self.requests[request_id] = req
        if params.num_samples > 1:  # the samples share the prompt's pages: only the head is queued
            make_group(req, params.num_samples).report_logprobs = not unasked_logprobs
        for sample in samples_of(req):
            if sample.samples_with_extras:
                self._with_extras[sample] = 0
            if params.stop:
                self.stop_strings.track(sample)
        self.scheduler.add(req)
        self._end_block_early()

    def _end_block_early(self) -> None:
        """A request arrived while a block streams its rows: ask the block to end after its running step (it would
        wait for the block's end to be admitted), where the scheduler can give the other steps back."""
        handle = self._streaming
        if handle is not None and not handle.stop_requested and can_shorten_block(self.scheduler, handle.out):
            self.runner.token_stream.request_stop(handle)

    def adopt_request(self, req: Request, num_pages: int) -> list[int] | None:
        """Take over `req`, which another engine of the same model and options checked, prefilled and sampled the
        first token of (disaggregated serving, cbjax/disaggregated.py): it joins the running set at once with
        `num_pages` fresh pages, returned for the caller to write its KV into before the next step; its first token
        is reported with the next step. None (nothing changed) when there is no room for it now
        (core/kv_handoff.py admit_prefilled). Plain sampling only: no sequence groups, no sampling extras."""
        pages = admit_prefilled(self.scheduler, req, num_pages)
        if pages is not None:
            self.requests[req.request_id] = req
            self._adopted.append(req)
            self._end_block_early()
            if req.params.stop:
                self.stop_strings.track(req)
                self.stop_strings.check([req])  # (its first token cannot complete one: its first engine checked)
        return pages

    def abort_request(self, request_id: str) -> None:
        """Finish a queued or running request now (finish_reason "abort"; its pages go back to the pool); its final
        output comes with the next step(). ValueError for an id that is not an unfinished request."""
        req = self.requests.get(request_id) if isinstance(request_id, str) else None
        if req is None or all(r.is_finished for r in samples_of(req)):
            raise ValueError(f"abort of unknown request id {request_id!r}")
        self._flush_rows()
        for sample in samples_of(req):
            if not sample.is_finished:
                self.scheduler.abort(sample)
        self._pending.append(req)

    @property
    def advances_clock(self) -> bool:
        """Whether the runner moves the clock itself (the simulator's does, by its cost model's step time)."""
        return self.runner.advances_clock

    def next_event_time(self) -> float | None:
        """When the policy will admit although no request arrives or finishes (a static batch's timeout), or None."""
        return self.scheduler.next_event_time()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending) or bool(self._in_flight)

    # ---- the step ---------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One iteration: schedule a step and start it on the device, then receive the results of the step before
        it, which ran meanwhile (asynchronous scheduling; with async_scheduling=False, of this same step). While a
        block of decode steps streams its rows (runner/token_stream.py), a call instead receives the block's next
        step. Returns an output for each request that got a token or finished (its `new_token_ids` is the stream
        delta)."""
        if self.timed is None:
            return self._step(False)
        with self.timed("step"):
            return self._step(False)

    def step_deltas(self) -> StepDeltas:
        """`step()` read in bulk: the same iteration, its outputs as a StepDeltas (core/outputs.py): each plain
        request's one new token in two lists (request ids, token ids), without an object per token; every other
        output as `step()` returns it. For a server or a harness that streams every token."""
        if self.timed is None:
            return self._step(True)
        with self.timed("step"):
            return self._step(True)

    def _step(self, bulk: bool) -> "list[RequestOutput] | StepDeltas":
        t0 = time.perf_counter()
        streaming = self._streaming
        if streaming is not None:  # a block's rows, one per call but its last (which comes with the next dispatch)
            if streaming.rows_received < streaming.out.num_steps - 1:
                outputs = self._receive_row(streaming, t0, bulk)
                if outputs is not None:
                    return outputs
            self._streaming = None
            self._flush_rows()
            if streaming.stop_requested:  # it was asked to end early (a request arrived): give back what did not run
                shorten_block(self.scheduler, streaming.out, self.runner.token_stream.steps_run(streaming))
        sched = self.scheduler
        changed: list[Request] = self._adopted  # (each counts as one token received: its first, made elsewhere)
        self._adopted = []
        spec = sched.speculator
        if spec is not None and self._in_flight and spec.wants_drafts(spec.batch_size(sched)):
            changed += self._receive(0, t0)  # drafts are proposed from every token: let the last ones arrive
        elif self._in_flight and self._with_extras and any(r.needs_host_history for r in self._with_extras):
            # A constraint's bitmask, a logits processor or a bad word of several tokens reads the outputs so far
            # on the host: receive them before packing the next step (async scheduling resumes once none runs).
            changed += self._receive(0, t0)
        before = scheduler_counters(sched)
        if self.timed is None:
            out = sched.schedule()
        else:
            with self.timed("schedule"):
                out = sched.schedule()
        dispatched = out.seqs or out.swap_out or out.swap_in
        if dispatched:
            if out.num_steps > 1:  # a block: its rows stream where the runner can (and something may arrive)
                self.runner.stream_rows = self.stream_rows
            handle = self.runner.dispatch(out)
            if out.num_steps > 1 and getattr(handle, "stream_base", None) is not None:
                self._streaming = handle
                if sched.waiting:  # (a request added while it was dispatched, by a runner's on_dispatch hook)
                    self._end_block_early()
            self._in_flight.append((handle, counters_since(sched, before)))
            self.num_steps += 1
        # A step that verifies drafts is received at once: how far its sequences advance is known only then.
        drafts = spec is not None and receives_at_once(out)  # (drafts, or a speculative block)
        keep = 1 if self.config.scheduler.async_scheduling and dispatched and not drafts else 0
        changed += self._receive(keep, t0)
        return self._outputs(changed, bulk)

    def _outputs(self, changed: list[Request], bulk: bool = False) -> "list[RequestOutput] | StepDeltas":
        """The outputs of a step() call: one per request in `changed` (only those that finished when outputs do not
        stream), and the final ones of requests aborted since (`bulk`: as a StepDeltas, for step_deltas())."""
        if not self.stream_outputs:  # building an output per token was ~10% of a simulated run's time
            changed = [r for r in changed if r.status is _FINISHED]
        timed, build = self.timed, self.output_builder
        make = build.deltas if bulk else build.outputs
        if timed is None:
            outputs = make(changed) if changed else StepDeltas() if bulk else []
        else:
            with timed("outputs"):
                outputs = make(changed) if changed else StepDeltas() if bulk else []
        if self._pending:
            (outputs.outputs if bulk else outputs).extend(build.output(r, 0) for r in self._pending)
            self._pending.clear()
        return outputs

    def _receive(self, keep: int, t0: float) -> list[Request]:
        """Receive the results of the oldest steps in flight until `keep` remain."""
        sched, spec = self.scheduler, self.scheduler.speculator
        changed: list[Request] = []
        while len(self._in_flight) > keep:
            handle, counts = self._in_flight.popleft()
            sampled = self.runner.fetch(handle)
            if self.after_execute is not None:
                self.after_execute()
            tally = spec.tally() if spec is not None else None
            host_s = device_s = 0.0
            eos, now = self.model_config.eos_token_id, self.clock.now()
            first = getattr(handle, "rows_received", 0)  # a streamed block's rows taken already (_receive_row)
            if first:
                sampled = sampled[first:]  # (the record adds the host and device time of the calls that took them)
                host_s, device_s = handle.row_host_s, handle.row_wait_s
            if self.timed is None:
                got = sched.update(handle.out, sampled, eos, now, first)
            else:
                with self.timed("update"):
                    got = sched.update(handle.out, sampled, eos, now, first)
            if self._with_extras:
                self._after_extras(got)
            if self.stop_strings:  # before the next step is scheduled: a request that met a stop string ends here
                self.stop_strings.check(got)
            changed += got
            # Host time: everything in this call but the waits for the device and the swap copies.
            host_s += time.perf_counter() - t0 - handle.wait_s - handle.swap_s
            device_s += handle.wait_s
            if spec is not None:
                out = handle.out
                per_step = (host_s + device_s) / out.num_steps  # (a block's steps each cost a share)
                counts |= spec.step_record(tally, out.num_draft_tokens, out.num_batched_tokens, per_step)
            self.step_records.append(step_record(self, handle, host_s, device_s, counts))
        return changed

    def _receive_row(self, handle: StepHandle, t0: float, bulk: bool) -> "list[RequestOutput] | StepDeltas | None":
        """The next row of the streaming block `handle` (its step's tokens, as that step ends on the device), received
        as a step's results are (or kept aside: cbjax/streamed_rows.py), and its outputs; None if the block stopped
        streaming (its rows come at its end)."""
        timed, sched, step = self.timed, self.scheduler, handle.rows_received
        waited = handle.row_wait_s  # (fetch_row adds its wait)
        with timed("fetch") if timed else _NOT_TIMED:
            row = self.runner.fetch_row(handle)
        if row is None:
            self._flush_rows()
            return None
        self.num_rows_received += 1
        eos, now = self.model_config.eos_token_id, self.clock.now()
        if step == 0:
            self._rows = StreamedRows.create(sched, handle.out, eos, self.output_builder)
        kept, streamed = None, self.stream_outputs
        if self._rows is not None:
            with timed("outputs") if timed else _NOT_TIMED:
                kept = self._rows.keep(row, step, now, build=streamed and not bulk)
            self._rows = self._rows if kept is not None else None
        if kept is None:
            with timed("update") if timed else _NOT_TIMED:
                got = sched.update(handle.out, (row,), eos, now, step)
            if self.stop_strings:
                self.stop_strings.check(got)
            outputs = self._outputs(got, bulk)
        elif not streamed:  # (a kept row finishes no request: only the final outputs of aborted ones)
            outputs = self._outputs([], bulk)
        elif bulk:  # every request of the block got this row's token (copies: the row is applied later)
            outputs = StepDeltas(list(self._rows.ids), list(row), self._outputs([]) if self._pending else [])
        else:
            outputs = kept + self._outputs([]) if self._pending else kept  # (+ the final outputs of aborted ones)
        handle.row_host_s += time.perf_counter() - t0 - (handle.row_wait_s - waited)
        return outputs

    def _flush_rows(self) -> None:
        """Apply a streaming block's kept rows to their requests (before anything reads them: streamed_rows.py)."""
        rows, self._rows = self._rows, None
        if rows is not None:
            with self.timed("update") if self.timed else _NOT_TIMED:
                rows.flush()

    def _after_extras(self, got: list[Request]) -> None:
        """Feed each constrained request's newly received outputs to its constraint (TokenConstraint.accept); abort
        a request whose sampling extras failed (a logits processor that raised: Request.error)."""
        for req in dict.fromkeys(got):
            n = self._with_extras.get(req)
            if n is not None and req.error is not None and not req.is_finished:
                self.abort_request(req.request_id)
                continue
            if n is not None and req.constraint is not None:
                known = req.known_output_token_ids
                if len(known) > n:
                    req.constraint.accept(known[n:])
                    self._with_extras[req] = len(known)

    def stream(self) -> Iterator[RequestOutput]:
        """Step until every request has finished, yielding each step's outputs (deltas in `new_token_ids`)."""
        while self.has_unfinished_requests():
            yield from self.step()

    @property
    def num_compiles(self) -> int:
        return self.runner.num_compiles

    def wait_until_warm(self) -> None:
        """Block until every step program is built (after which nothing compiles) and has run once (ModelRunner.prime):
        call before timing a run."""
        self.runner.wait_until_warm()

    def abort_all(self) -> None:
        for rid in [rid for rid, req in self.requests.items() if not req.is_finished]:
            self.abort_request(rid)
