"""DisaggregatedEngine: prompts on P prefill engines, decoding on D decode engines, KV pages moved in between.

Each engine is an LLMEngine (the same weights, its own scheduler, policy and KV pool) on its own device: prefill
engine i on jax.devices()[i % n], decode engine j on jax.devices()[(P + j) % n]. On a CPU host,
`XLA_FLAGS=--xla_force_host_platform_device_count=N` makes N fake devices: a functional check (they share the same
cores, so nothing here says whether disaggregation is faster), not a speed one. A request's life:

1. `add_request` checks it (a ValueError names the problem; nothing else is disturbed) and the prefill router
   (cbjax/core/routers.py, least load by default) gives it to a prefill engine as a request for one token
   (max_tokens=1), whose pages that engine's scheduler keeps when it finishes (core/kv_handoff.py). A request that
   asks for one token (prompt-only work), or whose first token ends it (EOS, a stop id or string), ends there.
2. The prefill engine computes the prompt (chunked, preempted, cached as its policy and options say) and samples
   the first token; its output is held back here.
3. The decode router (least load by default) picks a decode engine; it takes the request when it has nothing
   waiting (its preempted requests resume first), a free slot and the pages (LLMEngine.adopt_request), else the
   next least loaded engine that can does; when none can, the request waits here (first come, first served),
   its pages still held by the prefill engine.
4. The request's pages are gathered on the prefill device, copied to the decode device (jax.device_put) and
   scattered into the pages the decode engine gave it (cbjax/runner/kv_transfer.py); the prefill engine frees its
   pages. Each transfer is recorded (`transfers`: pages, bytes, seconds) and summed per step in `transfer_records`.
5. The decode engine decodes from token 2 on. A token's randomness is its (seed, output index) (runner/sampler.py),
   so with the request's seed the stream continues where the prefill engine left it; an unseeded request gets the
   seed a colocated LLMEngine would give it (from load.seed and its arrival index here). The first token is
   reported with the decode engine's next step, so TTFT includes the prefill, the wait for a decode engine and the
   transfer (as behind vLLM's disaggregated proxy).

Not supported (refused per request with a ValueError, or at construction): n > 1 / best_of, the sampling extras
(logprobs, penalties, min_tokens, bad words, logit bias, processors, structured output), prompt_logprobs,
speculative decoding, tensor parallelism, the prefix cache's host tier on decode engines, and the simulator's runner
(cbjax/sim/disaggregated.py simulates this).
"""

import bisect
import collections
import contextlib
import dataclasses
import time
from collections.abc import Iterator, Mapping

import jax

from cbjax.config import validation as check
from cbjax.core.clock import Clock, RealClock
from cbjax.core.engine_wrappers import engines_switch, engines_total
from cbjax.core.kv_handoff import KVHandoff, decode_request
from cbjax.core.outputs import CompletionOutput, RequestOutput
from cbjax.core.request import Request
from cbjax.core.routers import make_router
from cbjax.core.sampling_params import SamplingParams
from cbjax.data_parallel import owed_tokens
from cbjax.engine import LLMEngine
from cbjax.engine_config import EngineConfig
from cbjax.runner.kv_transfer import KVTransfer

# Options a role may not change: the pages' layout (a page moves as it is) and the requests' limits.
SHARED_OPTIONS = ("page_size", "kv_cache_dtype", "max_model_len", "runner", "tensor_parallel_size")
SPEC_KEYS = ("prefill", "decode", "prefill_router", "decode_router", "prefill_options", "decode_options")


@dataclasses.dataclass(frozen=True)
class Disaggregation:
    """`disaggregation=` of LLM / DisaggregatedEngine: how many engines of each role, their routers, and engine
    options for one role only (on top of the common ones: e.g. another policy or max_num_seqs)."""

    prefill: int = 1
    decode: int = 1
    prefill_router: str = "least_load"
    decode_router: str = "least_load"
    prefill_options: Mapping = dataclasses.field(default_factory=dict)
    decode_options: Mapping = dataclasses.field(default_factory=dict)

    @classmethod
    def from_option(cls, spec) -> "Disaggregation":
        spec = check.mapping("disaggregation", spec)
        unknown = sorted(set(map(str, spec)) - set(SPEC_KEYS))
        if unknown:
            raise ValueError(f"disaggregation: unknown keys {unknown} (known: {list(SPEC_KEYS)})")
        out = cls(**spec)
        check.integer("disaggregation prefill", out.prefill, 1)
        check.integer("disaggregation decode", out.decode, 1)
        for role in ("prefill", "decode"):
            options = check.mapping(f"disaggregation {role}_options", getattr(out, f"{role}_options"))
            fixed = sorted(set(options) & set(SHARED_OPTIONS))
            if fixed:
                raise ValueError(f"disaggregation {role}_options may not set {fixed}: both roles share them")
        return out


@dataclasses.dataclass
class _Handoff:
    """A request between its engines: prefilled on prefill engine `prefill` (its pages held there), waiting for a
    decode engine; `decode_request` is what the decode engine will run."""

    prefill: int
    prefill_request: Request
    decode_request: Request


def unsupported(params: SamplingParams) -> str | None:
    """Why the disaggregated engine refuses a request with these params, or None."""
    if params.num_samples > 1:
        return "n > 1 and best_of are not supported by the disaggregated engine"
    if params.needs_sampling_extras or params.prompt_logprobs is not None:
        return (
            "sampling extras (logprobs, prompt_logprobs, penalties, min_tokens, bad words, logit bias, logits "
            "processors, structured output) are not supported by the disaggregated engine"
        )
    return None


class DisaggregatedEngine:
    """`disaggregation.prefill` prefill LLMEngines and `disaggregation.decode` decode LLMEngines of `model`, sharing
    one clock, behind LLMEngine's API (add_request, abort_request, step, stream, has_unfinished_requests). Engine
    options are LLMEngine's and apply to both roles (`num_pages` is per engine); `disaggregation` (a Disaggregation
    or a dict of its fields) adds each role's own."""

    def __init__(self, model=None, *, disaggregation, clock: Clock | None = None, **options):
        spec = (
            disaggregation if isinstance(disaggregation, Disaggregation) else Disaggregation.from_option(disaggregation)
        )
        self.spec = spec
        roles = {
            r: EngineConfig().replace(**{**options, **getattr(spec, f"{r}_options")}) for r in ("prefill", "decode")
        }
        for config in roles.values():  # checked before anything is built
            if config.sim.enabled:
                raise ValueError("DisaggregatedEngine runs real engines; the simulator's is cbjax/sim/disaggregated.py")
            if config.speculative is not None or config.parallel.tensor_parallel_size > 1:
                raise ValueError("DisaggregatedEngine: speculative decoding and tensor parallelism are not supported")
        c = roles["decode"].cache
        if c.enable_prefix_caching and (c.host_cache_gib > 0 or (c.num_host_cache_pages or 0) > 0):
            # A decode engine's admission may evict a cached page whose copy to the host tier runs with its next
            # step, after the transfer has written the page: not supported yet (prefill engines may have the tier).
            raise ValueError("DisaggregatedEngine: the prefix cache's host tier is not supported on decode engines")
        self.prefill_router = make_router(spec.prefill_router)
        self.decode_router = make_router(spec.decode_router)
        self.clock = clock or RealClock()
        devices = jax.devices()
        place = lambda i, role: LLMEngine(model, config=roles[role], clock=self.clock, device=devices[i % len(devices)])
        self.prefill = [place(i, "prefill") for i in range(spec.prefill)]
        self.decode = [place(spec.prefill + j, "decode") for j in range(spec.decode)]
        first = self.prefill[0]
        self.config, self.model_config, self.tokenizer = first.config, first.model_config, first.tokenizer
        for e in self.prefill:
            e.scheduler.kv_handoff = KVHandoff(e.scheduler.pool)
        t0 = time.perf_counter()
        self.kv_transfer = KVTransfer(first.buckets.pages_per_seq)
        for e in self.prefill + self.decode:
            self.kv_transfer.warmup(e.runner)
        self.transfer_warmup_s = time.perf_counter() - t0
        self._owner: dict[str, tuple[str, int]] = {}  # unfinished request id -> (phase, engine index)
        # Requests on a prefill engine that move on to a decode engine -> (max_tokens, arrival index, the prefill
        # engine's request).
        self._moving: dict[str, tuple[int, int, Request]] = {}
        self._queue: collections.OrderedDict[str, _Handoff] = collections.OrderedDict()  # waiting for a decode engine
        self._aborted: list[RequestOutput] = []  # aborted while waiting, reported with the next step
        self._arrivals = 0
        self.transfers: list[dict] = []  # one record per KV transfer, in order
        self.transfer_records: list[dict] = []  # a record per step that moved KV (its transfers summed)
        self.num_routed = dict(prefill=[0] * spec.prefill, decode=[0] * spec.decode)

    # ---- engines ----------------------------------------------------------------------------------------------
    @property
    def engines(self) -> list[LLMEngine]:
        return self.prefill + self.decode

    stream_outputs = engines_switch("engines", "stream_outputs", "As LLMEngine.stream_outputs, for every engine.")
    stream_rows = engines_switch("engines", "stream_rows", "As LLMEngine.stream_rows, for every engine.")

    @property
    def requests(self) -> collections.ChainMap:
        """Every unfinished request by id (read-only view): on a prefill engine (as a one-token request), waiting
        for a decode engine (as the decode engine will run it), or on a decode engine."""
        waiting = {rid: h.decode_request for rid, h in self._queue.items()}
        return collections.ChainMap(waiting, *(e.requests for e in self.engines))

    def load(self, role: str = "decode") -> list[int]:
        """Tokens each engine of `role` ("prefill" or "decode") still owes its unfinished requests."""
        return [owed_tokens(e) for e in {"prefill": self.prefill, "decode": self.decode}[role]]

    # ---- requests ---------------------------------------------------------------------------------------------
    def add_request(
        self, request_id: str, prompt, params: SamplingParams | None = None, arrival_time=None, **kwargs
    ) -> None:
        """As LLMEngine.add_request (the same checks and messages, for the request's whole length on the decode
        engines); the prefill router picks the prefill engine."""
        if not isinstance(request_id, str):
            raise ValueError(f"request_id must be a string, got {request_id!r} ({type(request_id).__name__})")
        where = f"request {request_id!r}: "
        if request_id in self._owner:
            raise ValueError(f"{where}duplicate request id (a request with this id is unfinished)")
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"{where}params must be SamplingParams, got {type(params).__name__}")
        problem = unsupported(params)
        if problem:
            raise ValueError(where + problem)
        tokens = self._prompt_ids(prompt)  # None: malformed, the prefill engine refuses it with its reason
        moves_on = params.max_tokens > 1
        if tokens is not None and moves_on:
            self._check_fits_decode(where, len(tokens), params.max_tokens)
        seed = params.seed
        if seed is None:  # what a colocated LLMEngine would draw for this arrival
            seed = (self.config.load.seed * 1_000_003 + self._arrivals) % 2**32
        first = dataclasses.replace(params, seed=seed, max_tokens=1)
        i = self.prefill_router.choose(tokens or [], self.load("prefill"))
        engine = self.prefill[i]
        engine.add_request(request_id, prompt if tokens is None else tokens, first, arrival_time, **kwargs)
        self.num_routed["prefill"][i] += 1
        self._owner[request_id] = ("prefill", i)
        if moves_on:
            pre = engine.requests[request_id]
            engine.scheduler.kv_handoff.hold(pre)
            self._moving[request_id] = (params.max_tokens, self._arrivals, pre)
        self._arrivals += 1

    def _prompt_ids(self, prompt) -> list[int] | None:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt) if self.tokenizer is not None else None
        try:
            return check.token_ids("prompt", prompt, self.model_config.vocab_size) or None
        except ValueError:
            return None

    def _check_fits_decode(self, where: str, num_prompt: int, max_tokens: int) -> None:
        """The decode engines run the request to its end: it must fit every one of them (LLMEngine's messages)."""
        total = num_prompt + max_tokens
        for e in self.decode:
            max_len, cache = e.config.scheduler.max_model_len, e.config.cache
            if num_prompt <= max_len < total:
                raise ValueError(
                    f"{where}prompt ({num_prompt}) + max_tokens ({max_tokens}) = {total} "
                    f"exceeds max_model_len={max_len}"
                )
            if total <= max_len and not e.scheduler.can_ever_fit(total):
                raise ValueError(
                    f"{where}needs {-(-total // cache.page_size)} KV pages but a decode engine's pool has only "
                    f"{cache.num_pages}"
                )

    def abort_request(self, request_id: str) -> None:
        """As LLMEngine.abort_request, in either phase (or between them); its final output comes with the next
        step(). ValueError for an id that is not an unfinished request."""
        where = self._owner.get(request_id) if isinstance(request_id, str) else None
        if where is None:
            raise ValueError(f"abort of unknown request id {request_id!r}")
        phase, i = where
        if phase == "prefill":
            self.prefill[i].abort_request(request_id)
        elif phase == "decode":
            self.decode[i].abort_request(request_id)
        elif request_id not in self._queue:  # aborted already, its output not reported yet (as LLMEngine says)
            raise ValueError(f"abort of unknown request id {request_id!r}")
        else:  # between the engines: its held pages go back, and nothing moves
            h = self._queue.pop(request_id)
            self.prefill[h.prefill].scheduler.kv_handoff.release(h.prefill_request)
            self._aborted.append(self._abort_output(h.decode_request))

    def phase(self, request_id: str) -> str | None:
        """Where an unfinished request is: "prefill" (on a prefill engine), "queued" (prefilled, waiting for a
        decode engine), "decode" (on a decode engine); None for an id that is not an unfinished request."""
        where = self._owner.get(request_id)
        return None if where is None else where[0]

    def _abort_output(self, req: Request) -> RequestOutput:
        tokens = list(req.output_token_ids)
        text = None if self.tokenizer is None else self.tokenizer.decode(tokens)
        req.metrics.finished_time = self.clock.now()
        return RequestOutput(
            req.request_id,
            req.prompt_token_ids,
            [CompletionOutput(0, tokens, tokens, "abort", text)],
            True,
            req.metrics,
        )

    def has_unfinished_requests(self) -> bool:
        return bool(self._queue or self._aborted) or any(e.has_unfinished_requests() for e in self.engines)

    # ---- the step ---------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One step of every prefill engine with work, the transfers of the requests they prefilled (as decode
        engines have room), then one step of every decode engine with work. Returns the outputs for the client:
        a request's first token comes from its decode engine, once its KV is there."""
        outputs = []
        for i, engine in enumerate(self.prefill):
            if engine.has_unfinished_requests():
                outputs += [out for out in engine.step() if not self._moves_on(i, engine, out)]
        if self._queue:
            self._send()
        for engine in self.decode:
            if engine.has_unfinished_requests():
                outputs += engine.step()
        if self._aborted:
            outputs += self._aborted
            self._aborted = []
        for out in outputs:
            if out.finished:
                self._owner.pop(out.request_id, None)
        return outputs

    def _moves_on(self, i: int, engine: LLMEngine, out: RequestOutput) -> bool:
        """Whether prefill engine i's output `out` is of a request that moves on to a decode engine (queued here,
        not reported); otherwise the output is the client's (prompt-only work, a stop on the first token, an abort)."""
        rid = out.request_id
        if not out.finished or rid not in self._moving:
            return False
        max_tokens, arrival, pre = self._moving.pop(rid)
        handoff = engine.scheduler.kv_handoff
        if pre not in handoff.held:
            return False  # aborted: nothing held, nothing moves
        if out.outputs[0].finish_reason != "length":  # its first token stopped it (EOS, a stop id or string)
            handoff.release(pre)
            return False
        self._queue[rid] = _Handoff(i, pre, decode_request(pre, max_tokens, arrival))
        self._owner[rid] = ("queued", -1)
        return True

    def _send(self) -> None:
        """Move queued requests to decode engines, in order, while one has room."""
        moved = []
        while self._queue:
            rid, h = next(iter(self._queue.items()))
            prefill = self.prefill[h.prefill]
            src_pages = prefill.scheduler.kv_handoff.pages(h.prefill_request)
            loads = self.load("decode")
            chosen = self.decode_router.choose(h.decode_request.prompt_token_ids, loads)
            order = [chosen] + sorted((j for j in range(len(self.decode)) if j != chosen), key=lambda j: (loads[j], j))
            for j in order:
                dst_pages = self.decode[j].adopt_request(h.decode_request, len(src_pages))
                if dst_pages is not None:
                    break
            else:
                break  # no decode engine has room: it waits, and so do the requests behind it
            t = self.kv_transfer.send(prefill.runner, src_pages, self.decode[j].runner, dst_pages)
            prefill.scheduler.kv_handoff.release(h.prefill_request)
            now = self.clock.now()
            m = h.decode_request.metrics
            m.first_token_time = now
            m.token_times.append(now)
            del self._queue[rid]
            self._owner[rid] = ("decode", j)
            self.num_routed["decode"][j] += 1
            record = dict(request_id=rid, prefill=h.prefill, decode=j, time=now, **dataclasses.asdict(t))
            self.transfers.append(record)
            moved.append(record)
        if moved:
            self.transfer_records.append(
                dict(
                    time=self.clock.now(),
                    kv_transfers=len(moved),
                    kv_transfer_pages=sum(r["num_pages"] for r in moved),
                    kv_transfer_bytes=sum(r["nbytes"] for r in moved),
                    kv_transfer_s=sum(r["copy_s"] for r in moved),
                    kv_transfer_wait_s=sum(r["wait_s"] for r in moved),
                )
            )

    def stream(self) -> Iterator[RequestOutput]:
        while self.has_unfinished_requests():
            yield from self.step()

    # ---- what LLMEngine also offers ---------------------------------------------------------------------------
    def next_event_time(self) -> float | None:
        times = [t for e in self.engines if (t := e.next_event_time()) is not None]
        return min(times) if times else None

    @property
    def advances_clock(self) -> bool:
        return False

    num_steps = engines_total("engines", "num_steps", "Steps dispatched, summed over the engines.")
    num_rows_received = engines_total("engines", "num_rows_received", "As LLMEngine.num_rows_received, summed.")

    @property
    def buckets(self):
        return self.prefill[0].buckets

    @property
    def after_execute(self):
        return self.prefill[0].after_execute

    @after_execute.setter
    def after_execute(self, hook) -> None:
        for e in self.engines:
            e.after_execute = hook

    @property
    def num_compiles(self) -> int:
        return sum(e.num_compiles for e in self.engines)

    @property
    def warmup_s(self) -> float:
        return sum(e.warmup_s for e in self.engines) + self.transfer_warmup_s

    @property
    def step_records(self) -> list[dict]:
        """Every engine's step records (cbjax.bench.metrics.StepRecord's fields), each with its engine's index in
        `engines` as "replica": prefill engines 0..P-1, then decode engines. Each KV transfer is charged to the first
        step of its decode engine after it (kv_transfers, kv_transfer_bytes, kv_transfer_s): the step that first
        runs the adopted request; per-call totals are in `transfer_records`."""
        records = [{**r, "replica": i} for i, e in enumerate(self.engines) for r in e.step_records]
        by_engine = collections.defaultdict(list)
        for r in records:
            by_engine[r["replica"]].append(r)
        times = {i: [r["scheduled_time"] for r in steps] for i, steps in by_engine.items()}
        for t in self.transfers:
            engine = len(self.prefill) + t["decode"]
            steps = by_engine[engine]
            i = bisect.bisect_left(times.get(engine, []), t["time"])
            if i < len(steps):  # (a transfer whose step has not run yet is in no record)
                r = steps[i]
                r["kv_transfers"] = r.get("kv_transfers", 0) + 1
                r["kv_transfer_bytes"] = r.get("kv_transfer_bytes", 0) + t["nbytes"]
                r["kv_transfer_s"] = r.get("kv_transfer_s", 0.0) + t["copy_s"]
        return records

    def transfer_summary(self) -> dict:
        """What the transfers moved: how many, pages, bytes, and seconds (copy, and waiting for the prefill device)."""
        t = self.transfers
        return dict(
            num_transfers=len(t),
            pages=sum(r["num_pages"] for r in t),
            bytes=sum(r["nbytes"] for r in t),
            copy_s=sum(r["copy_s"] for r in t),
            wait_s=sum(r["wait_s"] for r in t),
        )

    def wait_until_warm(self) -> None:
        for e in self.engines:
            e.wait_until_warm()

    def abort_all(self) -> None:
        for rid in list(self._owner):
            with contextlib.suppress(ValueError):  # (one aborted already, its output not reported yet)
                self.abort_request(rid)
