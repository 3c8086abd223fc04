"""LLMEngine: add requests, step, stream; one step = schedule -> execute -> update.

The engine owns the request table, validates input (a bad request is refused with a ValueError and nothing else
is disturbed), and records per-step statistics for the metrics.
"""

import collections
import dataclasses
import os
import time
from collections.abc import Callable, Iterator, Sequence

import jax

from cbjax.core import validation as check
from cbjax.core.clock import Clock, RealClock, VirtualClock
from cbjax.core.outputs import CompletionOutput, RequestOutput
from cbjax.core.request import Request, RequestStatus
from cbjax.core.sampling_params import SamplingParams
from cbjax.core.scheduler import Scheduler, SchedulerConfig
from cbjax.core.speculator import Speculator
from cbjax.draft_model import check_draft_model, draft_config, load_draft_model
from cbjax.engine_config import EngineConfig
from cbjax.memory_fit import check_fits, device_memory_bytes, host_memory_bytes
from cbjax.model.config import ModelConfig, get_model_config
from cbjax.model.hf_loader import load_hf_model
from cbjax.model.linear_impl import serving_model
from cbjax.model.llama import Llama, init_model, kv_cache_bytes_per_page
from cbjax.model.registry import model_config_of, resolve_checkpoint
from cbjax.model.tokenizer import Tokenizer
from cbjax.runner.acceptance import make_rule
from cbjax.runner.compile_cache import configure_compilation_cache
from cbjax.runner.model_runner import ModelRunner
from cbjax.runner.sharding import make_mesh
from cbjax.runner.step_handle import StepHandle
from cbjax.runner.step_input import BucketTable
from cbjax.sim import SimRunner, engine_cost_model
from kernels_pallas.dispatch import resolve_backend


class LLMEngine:
    """Serve many requests at once with iteration-level scheduling over a paged KV cache.

    `model` is a named config ("llama-tiny", "llama-small", "test-tiny"), a ModelConfig, a Llama instance, a Hugging
    Face checkpoint directory (config.json + safetensors [+ tokenizer.json]), a packaged model's name ("tinypy",
    "tinypy-draft"), or None for the packaged default. With a tokenizer, prompts may be text (`self.tokenizer`).
    Engine options are EngineConfig's fields as keywords. `device` places the engine's parameters, KV pages and
    programs on that device (default: jax's first); a data-parallel engine (cbjax/data_parallel.py) gives each of
    its replicas one. With runner="sim" no weights are loaded and nothing is compiled: the same Scheduler drives a
    cbjax.sim.SimRunner on a VirtualClock (docs/sim.md).
    """

    def __init__(
        self,
        model: "str | ModelConfig | Llama | None" = "llama-tiny",
        *,
        clock: Clock | None = None,
        device: "jax.Device | None" = None,
        cost_model=None,
        **options,
    ):
        """`cost_model` (runner="sim" only): a cbjax.sim cost model object, instead of sim_profile/sim_accelerator."""
        cfg = EngineConfig.from_options(options)  # every option checked before anything is loaded or compiled
        sim = cfg.runner == "sim"
        drafter = cfg.speculative_config.draft_model if cfg.speculative_config is not None else None
        if drafter is not None:
            check_draft_model(model, drafter, cfg.max_model_len)
        if sim:
            # The simulator: no weights, no compile; the model's shapes only (docs/sim.md).
            self.clock = VirtualClock() if clock is None else clock
            self.compilation_cache_dir = None
            self.model, self.tokenizer, mcfg = None, *self._model_config(model, cfg)
            cost_model = engine_cost_model(cfg, mcfg, cost_model)
        else:
            if cost_model is not None:
                raise ValueError("cost_model is for runner='sim' only")
            self.clock = clock or RealClock()
            # First: building the model may compile too.
            self.compilation_cache_dir = configure_compilation_cache(cfg.compilation_cache)
            self.model, self.tokenizer = self._load_model(model, cfg)
            tp = cfg.tensor_parallel_size
            self.model = serving_model(self.model, cfg.quantization, cfg.cpu_matmul, tp)  # int8, packed, or as is
            mcfg = self.model.cfg
        self.model_config = mcfg
        max_model_len = cfg.max_model_len or mcfg.max_position_embeddings
        if max_model_len > mcfg.max_position_embeddings:
            raise ValueError(
                f"max_model_len={max_model_len} exceeds the model's max_position_embeddings "
                f"({mcfg.max_position_embeddings}); choose max_model_len <= {mcfg.max_position_embeddings}"
            )
        num_pages = cfg.num_pages
        if num_pages is None and sim and hasattr(cost_model, "kv_pages"):
            num_pages = cost_model.kv_pages(cfg.page_size)  # what the accelerator's memory holds after the weights
            if num_pages < 1:
                raise ValueError(f"the simulated accelerator's memory holds no KV page after the weights: {cost_model}")
        if num_pages is None:
            page_bytes = kv_cache_bytes_per_page(mcfg, cfg.page_size, cfg.kv_cache_dtype)
            if drafter is not None:  # the draft's KV pages mirror the target's (cbjax/runner/draft_runner.py)
                page_bytes += kv_cache_bytes_per_page(draft_config(drafter), cfg.page_size, cfg.kv_cache_dtype)
            num_pages = int(cfg.kv_cache_memory_gib * 2**30) // page_bytes
            if num_pages < 1:
                raise ValueError(
                    f"kv_cache_memory_gib={cfg.kv_cache_memory_gib} holds no KV page (one page of {cfg.page_size} "
                    f"tokens takes {page_bytes} bytes for this model); raise it or set num_pages"
                )
        num_host_pages = 0
        if cfg.preemption_mode == "swap":
            num_host_pages = cfg.num_host_pages
            if num_host_pages is None:
                num_host_pages = int(cfg.swap_space_gib * 2**30) // kv_cache_bytes_per_page(
                    mcfg, cfg.page_size, cfg.kv_cache_dtype
                )
        if not sim:  # (a simulated accelerator's pool is not this machine's memory)
            check_fits("KV cache (num_pages / kv_cache_memory_gib)", num_pages, mcfg, cfg, device_memory_bytes())
            check_fits(
                "host swap pool (num_host_pages / swap_space_gib)", num_host_pages, mcfg, cfg, host_memory_bytes()
            )
        self.config = cfg = dataclasses.replace(
            cfg, num_pages=num_pages, max_model_len=max_model_len, num_host_pages=num_host_pages
        )
        spec, sizes = cfg.speculative_config, (cfg.max_num_batched_tokens, max_model_len, cfg.page_size)
        k = 0 if spec is None else spec.num_speculative_tokens  # drafts verified per sequence and step, at most
        self.buckets = BucketTable.build(*sizes, cfg.max_num_seqs, max_draft_tokens=k)
        # Built before the model runner so a bad policy, policy option or preemption mode fails before any compile.
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=cfg.max_num_seqs,
                max_num_batched_tokens=cfg.max_num_batched_tokens,
                page_size=cfg.page_size,
                num_pages=num_pages,
                max_model_len=max_model_len,
                policy=cfg.policy,
                policy_options=dict(cfg.policy_options or {}),
                enable_chunked_prefill=cfg.enable_chunked_prefill,
                watermark_pages=int(cfg.watermark_fraction * num_pages),
                static_batch_timeout_s=cfg.static_batch_timeout_s,
                preemption_mode=cfg.preemption_mode,
                num_host_pages=num_host_pages,
                enable_prefix_caching=cfg.enable_prefix_caching,
                sliding_window=mcfg.sliding_window,
                evict_outside_window=cfg.evict_outside_window,
                num_scheduler_steps=cfg.num_scheduler_steps,
            ),
            self.clock,
            speculator=None if spec is None else Speculator(spec),
        )
        self.runner = self._sim_runner(cfg, cost_model) if sim else self._model_runner(cfg, device)
        mode = {True: "full", False: "none"}.get(cfg.warmup, cfg.warmup)
        self.warmup_s = self.runner.warmup(mode)
        self.requests: dict[str, Request] = {}
        self._pending: list[Request] = []  # finished outside a step (aborts) and not yet reported
        self._arrivals = 0
        self.step_records: list[dict] = []
        self._in_flight: collections.deque = collections.deque()  # (StepHandle, its scheduler counters), oldest first
        self.num_steps = 0  # steps dispatched
        # Called after the model ran and before its tokens are stamped with the clock's time: a simulation moves
        # its virtual clock here, so a token's time is the end of the step that made it (cbjax.bench.online).
        self.after_execute: Callable[[], None] | None = None
        # False: `step` returns outputs only for requests that finished (a benchmark harness that reads each
        # request's result once); True: also one per request that got a token (streaming, the default).
        self.stream_outputs = True

    def _model_runner(self, cfg: EngineConfig, device) -> ModelRunner:
        return ModelRunner(
            self.model,
            num_pages=cfg.num_pages,
            page_size=cfg.page_size,
            buckets=self.buckets,
            backend=resolve_backend(cfg.attention_backend),
            interpret=cfg.pallas_interpret,
            num_host_pages=cfg.num_host_pages,
            program_cache_dir=None
            if self.compilation_cache_dir is None
            else os.path.join(self.compilation_cache_dir, "cbjax-programs"),
            device=device,
            mesh=None if cfg.tensor_parallel_size == 1 else make_mesh(cfg.tensor_parallel_size),
            kv_cache_dtype=cfg.kv_cache_dtype,
            draft_model=self._draft_model(cfg),
            acceptance=None if cfg.speculative_config is None else make_rule(cfg.speculative_config.acceptance),
            num_scheduler_steps=cfg.num_scheduler_steps,
        )

    @staticmethod
    def _draft_model(cfg: EngineConfig) -> "Llama | None":
        spec = cfg.speculative_config
        if spec is None or spec.draft_model is None:
            return None
        return load_draft_model(spec.draft_model, cfg.dtype, cfg.matmul_dtype)

    def _sim_runner(self, cfg: EngineConfig, cost_model) -> SimRunner:
        mcfg = self.model_config
        return SimRunner(
            cost_model,
            self.clock,
            buckets=self.buckets,
            kv_bytes_per_page=kv_cache_bytes_per_page(mcfg, cfg.page_size, cfg.kv_cache_dtype),
            vocab_size=mcfg.vocab_size,
            eos_token_id=mcfg.eos_token_id,
            stop_token_ids=mcfg.extra_eos_token_ids,
        )

    @staticmethod
    def _model_config(model, cfg: EngineConfig) -> "tuple[Tokenizer | None, ModelConfig]":
        """The simulator's model: its config (and tokenizer, for a checkpoint), no weights."""
        if isinstance(model, Llama):
            raise ValueError("runner='sim' takes a model name or a ModelConfig, not a built Llama")
        checkpoint = resolve_checkpoint(model)
        mcfg = model if isinstance(model, ModelConfig) else model_config_of(model)
        mcfg = mcfg.replace(**{k: getattr(cfg, k) for k in ("dtype", "matmul_dtype") if getattr(cfg, k) is not None})
        return (None if checkpoint is None else Tokenizer.from_dir(checkpoint[0])), mcfg

    @staticmethod
    def _load_model(model, cfg: EngineConfig) -> "tuple[Llama, Tokenizer | None]":
        if isinstance(model, Llama):
            return model, None
        sharded = cfg.tensor_parallel_size > 1  # the runner places each shard on its device straight from the host
        checkpoint = resolve_checkpoint(model)
        if checkpoint is not None:
            path, default_dtype = checkpoint
            model = load_hf_model(path, cfg.dtype or default_dtype, cfg.matmul_dtype, on_host=sharded)
            return model, Tokenizer.from_dir(path)
        mcfg = get_model_config(model) if isinstance(model, str) else model
        if not isinstance(mcfg, ModelConfig):
            raise ValueError(f"model must be a name, a ModelConfig or a Llama, got {type(model).__name__}")
        if cfg.dtype is not None:
            mcfg = mcfg.replace(dtype=cfg.dtype)
        if cfg.matmul_dtype is not None:
            mcfg = mcfg.replace(matmul_dtype=cfg.matmul_dtype)
        return init_model(mcfg, cfg.seed, on_host=sharded), None

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
        mcfg, cfg = self.model_config, self.config
        try:
            tokens = self._prompt_token_ids(prompt)
            check.token_ids("stop_token_ids", params.stop_token_ids, mcfg.vocab_size)
            priority = check.integer("priority", priority)
            tenant = check.text("tenant", tenant, empty=True)
            deadline = check.optional_real("deadline", deadline)
            arrival_time = check.optional_real("arrival_time", arrival_time)
        except ValueError as e:
            raise ValueError(where + str(e)) from None
        total = len(tokens) + params.max_tokens
        if mcfg.extra_eos_token_ids and not params.ignore_eos:
            # The scheduler stops on one eos id; the checkpoint's other eos ids become stop tokens (same reason).
            params = dataclasses.replace(params, stop_token_ids=params.stop_token_ids + mcfg.extra_eos_token_ids)
        if len(tokens) > cfg.max_model_len:
            raise ValueError(f"{where}prompt of {len(tokens)} tokens is longer than max_model_len={cfg.max_model_len}")
        if total > cfg.max_model_len:
            raise ValueError(
                f"{where}prompt ({len(tokens)}) + max_tokens ({params.max_tokens}) "
                f"= {total} exceeds max_model_len={cfg.max_model_len}"
            )
        if not self.scheduler.can_ever_fit(total):
            raise ValueError(
                f"{where}needs {-(-total // cfg.page_size)} KV pages but the pool has only {cfg.num_pages}"
            )
        seed = params.seed if params.seed is not None else (cfg.seed * 1_000_003 + self._arrivals) % 2**32
        now = self.clock.now() if arrival_time is None else arrival_time
        req = Request(
            request_id, tokens, params, now, seed, self._arrivals, priority=priority, tenant=tenant, deadline=deadline
        )
        self._arrivals += 1
        self.requests[request_id] = req
        self.scheduler.add(req)

    def _prompt_token_ids(self, prompt) -> list[int]:
        """A prompt's token ids: text (with a tokenizer) or a sequence of integer ids in the vocabulary."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer; this model has none, pass token ids")
            prompt = self.tokenizer.encode(prompt)
        tokens = check.token_ids("prompt", prompt, self.model_config.vocab_size)
        if not tokens:
            raise ValueError("empty prompt")
        return tokens

    def abort_request(self, request_id: str) -> None:
        """Finish a queued or running request now (finish_reason "abort"; its pages go back to the pool); its final
        output comes with the next step(). ValueError for an id that is not an unfinished request."""
        req = self.requests.get(request_id) if isinstance(request_id, str) else None
        if req is None or req.is_finished:
            raise ValueError(f"abort of unknown request id {request_id!r}")
        self.scheduler.abort(req)
        self._pending.append(req)

    @property
    def advances_clock(self) -> bool:
        """Whether the runner moves the clock itself (the simulator's does, by its cost model's step time)."""
        return getattr(self.runner, "advances_clock", False)

    def next_event_time(self) -> float | None:
        """When the policy will admit although no request arrives or finishes (a static batch's timeout), or None."""
        return self.scheduler.next_event_time()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending) or bool(self._in_flight)

    # ---- the step ---------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One iteration: schedule a step and start it on the device, then receive the results of the step before
        it, which ran meanwhile (asynchronous scheduling; with async_scheduling=False, of this same step). Returns an
        output for each request that got a token or finished (its `new_token_ids` is the stream delta)."""
        t0 = time.perf_counter()
        sched = self.scheduler
        changed: list[Request] = []
        spec = sched.speculator
        if spec is not None and self._in_flight and spec.wants_drafts(spec.batch_size(sched)):
            changed += self._receive(0, t0)  # drafts are proposed from every token: let the last ones arrive
        before = self._counters()
        out = sched.schedule()
        dispatched = out.seqs or out.swap_out or out.swap_in
        if dispatched:
            handle = self.runner.dispatch(out)
            self._in_flight.append((handle, {k: v - before[k] for k, v in self._counters().items()}))
            self.num_steps += 1
        # A step that verifies drafts is received at once: how far its sequences advance is known only then.
        drafts = spec is not None and out.num_draft_tokens  # (a sum over the step's sequences: only with drafts)
        keep = 1 if self.config.async_scheduling and dispatched and not drafts else 0
        changed += self._receive(keep, t0)
        if not self.stream_outputs:  # building an output per token was ~10% of a simulated run's time
            finished = RequestStatus.FINISHED  # (a local: reading an enum member costs ~0.1 us on Python 3.11)
            changed = [r for r in changed if r.status is finished]
        # Once per token received (speculation, blocks: several a step); often none when streaming is off (no Counter)
        new_tokens = collections.Counter(changed) if changed else {}
        outputs = [self._output(r, n) for r, n in new_tokens.items()] + [self._output(r, 0) for r in self._pending]
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
            changed += sched.update(handle.out, sampled, self.model_config.eos_token_id, self.clock.now())
            # Host time: everything in this call but the waits for the device and the swap copies.
            host_s = time.perf_counter() - t0 - handle.wait_s - handle.swap_s
            if spec is not None:
                out = handle.out
                counts |= spec.step_record(tally, out.num_draft_tokens, out.num_batched_tokens, host_s + handle.wait_s)
            self._record_step(handle, host_s, counts)
        return changed

    def _counters(self) -> dict[str, int]:
        sched = self.scheduler
        return dict(
            num_preemptions=sched.num_preemptions,
            recomputed_tokens=sched.num_recomputed_tokens,
            prefix_queried_tokens=sched.pool.queried_tokens,
            prefix_hit_tokens=sched.pool.hit_tokens,
        )

    def _output(self, req: Request, num_new: int) -> RequestOutput:
        finished = req.status is RequestStatus.FINISHED
        if finished:
            self.requests.pop(req.request_id, None)
        reason = req.finish_reason.value if req.finish_reason is not None else None
        n = len(req.output_token_ids) - req.num_pending_tokens
        tokens = req.output_token_ids[:n]  # what the host has received (known_output_token_ids)
        new = tokens[n - num_new :] if num_new else []
        return RequestOutput(
            req.request_id,
            req.prompt_token_ids,
            [CompletionOutput(0, tokens, new, reason)],
            finished,
            req.metrics,
            error=req.error,
        )

    def _record_step(self, handle: StepHandle, host_s: float, counts: dict[str, int]) -> None:
        sched, runner, out = self.scheduler, self.runner, handle.out
        self.step_records.append(
            dict(
                time=self.clock.now(),
                num_running=len(sched.running),
                num_waiting=len(sched.waiting),
                num_scheduled_seqs=len(out.seqs),
                max_num_seqs=self.config.max_num_seqs,
                num_scheduled_tokens=out.num_batched_tokens,
                padded_tokens=handle.padded_tokens,
                decode_steps=out.num_steps,  # > 1: a block of decode steps (core/multi_step.py)
                block_wasted_tokens=out.num_wasted_tokens,
                kv_pages_used=sched.pool.num_used,
                kv_pages_total=sched.pool.num_pages,
                host_s=host_s,
                device_s=handle.wait_s,
                compiles=runner.num_compiles,
                swap_out_bytes=handle.swap_out_bytes,
                swap_in_bytes=handle.swap_in_bytes,
                swap_s=handle.swap_s,
                **counts,
            )
        )

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
        wait = getattr(self.runner, "wait_for_programs", None)  # (the model runner's; the simulator has none)
        wait() if wait is not None else self.runner.programs.wait()

    def abort_all(self) -> None:
        for rid in [rid for rid, req in self.requests.items() if not req.is_finished]:
            self.abort_request(rid)
