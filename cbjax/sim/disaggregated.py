"""DisaggregatedSim: disaggregated serving on the simulator. P prefill engines compute prompts, D decode engines
generate the rest, and each request's KV pages cross a link (cbjax/sim/links.py) in between.

The engines are simulated LLMEngines (runner="sim": the real Scheduler with its own policy, a SimRunner pricing
steps with a cost model, e.g. the roofline of an accelerator), built by the caller, each on its own VirtualClock.
A request's life:

1. add_request: a router (cbjax/core/routers.py, least load by default) picks a prefill engine; the request joins
   it with max_tokens=1, so the prefill engine computes the prompt and samples the first token, then finishes it
   (its pages return to the pool then: the prefill side does not hold them while they are sent, a small optimism).
   A request with max_tokens=1, or whose first token ends it, finishes there.
2. The first token's step ended at t: the transfer of the prompt's KV pages (pages x bytes per page) is queued on
   the prefill engine's outbound link (LinkQueue: FIFO, `bytes / bandwidth + latency`), while the prefill engine
   goes on stepping. A second router picks the decode engine then, from the decode engines' loads (the tokens
   their requests and the transfers on their way to them still owe).
3. At its arrival the KV lands in the decode engine's host pool (so decode engines need preemption_mode="swap")
   and the request joins that engine's scheduler as a swapped-out request: prompt computed, first token known.
   The scheduler admits it by its policy like any swapped-out request (device pages allocated, a swap-in
   scheduled); that swap-in is not priced again (SimRunner.prepaid_host_pages): the link already moved the bytes.
   If the host pool is full, the transfer waits there until it has room (the decode side pushes back).
4. The decode engine decodes it to the end. Its first token counts as received at the transfer's arrival (TTFT
   includes the transfer, as behind vLLM's disaggregated proxy); its record has the request's whole life
   (arrival, first scheduling on the prefill engine, tokens, preemptions on both sides).

Time: the engines are stepped in time order, each on its own clock (cbjax/sim/engine_set.py, which also holds
ReplicatedSim, the colocated counterpart on as many devices). Driven by cbjax.bench.online's run_online like an
LLMEngine, so its records and summary are the colocated simulator's (cbjax.bench.metrics). Plain sampling only
(no n > 1, stop strings, logprobs or sampling extras).

The decode engine takes the request through its public parts (its `requests` table and `scheduler.add`) rather
than `add_request`, which would make a fresh request with nothing computed.
"""

import dataclasses
import heapq

from cbjax.core.engine_wrappers import engines_switch
from cbjax.core.outputs import CompletionOutput, RequestMetrics, RequestOutput
from cbjax.core.request import Request
from cbjax.core.routers import make_router
from cbjax.core.sampling_params import SamplingParams
from cbjax.core.scheduler_config import pages_for
from cbjax.sim.engine_set import SimulatedEngines, owed_tokens
from cbjax.sim.links import Link, LinkQueue, get_link


@dataclasses.dataclass
class KVTransfer:
    """One request's KV on its way from a prefill engine to a decode engine (times on the run's clock)."""

    request_id: str
    prefill: int
    decode: int
    num_pages: int
    nbytes: int
    ready: float  # the first token's step ended
    start: float  # the link took it (later than ready when the link was busy)
    arrival: float  # ready + link wait + nbytes / bandwidth + latency
    output: RequestOutput  # the prefill engine's output: prompt, first token, metrics so far
    params: SamplingParams
    extra: dict  # priority, tenant, deadline

    def to_dict(self) -> dict:
        keys = ("request_id", "prefill", "decode", "num_pages", "nbytes", "ready", "start", "arrival")
        return {k: getattr(self, k) for k in keys}


class DisaggregatedSim(SimulatedEngines):
    """P prefill and D decode simulated engines behind one engine-like API (add_request, step, ...), the KV of each
    request sent over `link` (a Link or a name in cbjax.sim.links.LINKS)."""

    def __init__(
        self,
        prefill: list,
        decode: list,
        *,
        link: "str | Link" = "nvlink",
        prefill_router: str = "least_load",
        decode_router: str = "least_load",
    ):
        if not prefill or not decode:
            raise ValueError(f"a disaggregated simulation needs >= 1 prefill and decode engine, got "
                             f"{len(prefill)} and {len(decode)}")  # fmt: skip
        super().__init__(list(prefill) + list(decode))  # step records' `replica`: prefill 0..P-1, then decode
        self.prefill, self.decode = list(prefill), list(decode)
        for i, e in enumerate(self.decode):
            if e.scheduler.host_pool is None:
                raise ValueError(f"decode engine {i} has no host pool: the KV it receives lands there; build it "
                                 "with preemption_mode='swap' and num_host_pages > 0")  # fmt: skip
        self.link = get_link(link)
        self.prefill_router = make_router(prefill_router)
        self.decode_router = make_router(decode_router)
        self.links = [LinkQueue(self.link) for _ in self.prefill]  # each prefill engine's outbound link
        self.transfers: list[KVTransfer] = []  # every transfer sent, in order
        self._in_flight: list[tuple[float, int, KVTransfer]] = []  # heap by arrival
        self._blocked: list[KVTransfer] = []  # arrived, waiting for room in their decode engine's host pool
        self._owed = [0] * len(self.decode)  # tokens the transfers in flight to each decode engine will owe it
        self._params: dict[str, tuple[SamplingParams, dict]] = {}  # unfinished requests on a prefill engine
        for e in self.prefill:  # a prefill engine's outputs are read once, when its part is done
            e.stream_outputs = False

    stream_outputs = engines_switch(
        "decode",
        "stream_outputs",
        "As LLMEngine.stream_outputs, for the decode engines (prefill engines report only what they finish).",
    )

    # ---- requests -----------------------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None, arrival_time=None, **extra):
        """As LLMEngine.add_request (priority, tenant, deadline in `extra`); a router picks the prefill engine."""
        params = params if params is not None else SamplingParams()
        where = f"request {request_id!r}: "
        if request_id in self._params or any(request_id in e.requests for e in self.engines):
            raise ValueError(where + "duplicate request id (a request with this id is unfinished)")
        if not isinstance(params, SamplingParams):
            raise ValueError(where + f"params must be SamplingParams, got {type(params).__name__}")
        if params.num_samples > 1 or params.stop or params.needs_sampling_extras or params.logprobs is not None:
            raise ValueError(where + "the disaggregated simulator takes plain sampling (no n > 1, best_of, stop "
                             "strings, logprobs or sampling extras)")  # fmt: skip
        total = len(prompt) + params.max_tokens
        if params.max_tokens > 1 and not all(e.scheduler.can_ever_fit(total) for e in self.decode):
            raise ValueError(where + f"{total} tokens do not fit a decode engine's KV pool")
        engine = self.prefill[self.prefill_router.choose(prompt, [owed_tokens(e) for e in self.prefill])]
        self._wake(engine)
        first = dataclasses.replace(params, max_tokens=1) if params.max_tokens > 1 else params
        engine.add_request(request_id, prompt, first, arrival_time, **extra)
        self._params[request_id] = (params, extra)

    # ---- between the engines -------------------------------------------------------------------------------------
    def _pending(self) -> bool:
        return bool(self._in_flight or self._blocked)

    def _event_times(self) -> list[float]:
        return [t for t, _, _ in self._in_flight[:1]]  # (blocked transfers wait for their engine's steps)

    def _stepped(self, engine, outputs: list) -> list:
        if engine not in self.prefill:
            return outputs
        i = self.prefill.index(engine)
        return [o for out in outputs if out.finished for o in self._prefilled(i, out)]

    def _prefilled(self, i: int, out: RequestOutput) -> list[RequestOutput]:
        """A prefill engine finished `out`: send its KV on (returns nothing), or return it when it is done."""
        params, extra = self._params.pop(out.request_id)
        comp = out.outputs[0]
        if comp.finish_reason != "length" or params.max_tokens <= 1 or len(comp.token_ids) != 1:
            return [out]  # max_tokens=1, a stop token, an abort: the request ends here
        engine = self.prefill[i]
        num_pages = pages_for(len(out.prompt_token_ids), engine.config.cache.page_size)
        nbytes = num_pages * engine.runner.kv_bytes_per_page
        ready = out.metrics.finished_time
        start, arrival = self.links[i].send(ready, nbytes)
        loads = [owed_tokens(e) + owed for e, owed in zip(self.decode, self._owed)]
        d = self.decode_router.choose(out.prompt_token_ids, loads)
        self._owed[d] += params.max_tokens - 1
        transfer = KVTransfer(out.request_id, i, d, num_pages, nbytes, ready, start, arrival, out, params, extra)
        self.transfers.append(transfer)
        heapq.heappush(self._in_flight, (arrival, len(self.transfers), transfer))
        return []

    def _between(self, until: float) -> None:
        """Hand every transfer that has arrived by `until` to its decode engine, in order of arrival; one whose
        engine's host pool is full waits (blocked) until that engine has freed room."""
        arrived, self._blocked = self._blocked, []
        while self._in_flight and self._in_flight[0][0] <= until:
            arrived.append(heapq.heappop(self._in_flight)[2])
        for transfer in arrived:
            engine = self.decode[transfer.decode]
            host = engine.scheduler.host_pool
            num_pages = pages_for(len(transfer.output.prompt_token_ids), engine.config.cache.page_size)
            if not host.can_allocate(num_pages):
                self._blocked.append(transfer)
                continue
            self._wake(engine, max(transfer.arrival, self.clock.now()))
            self._owed[transfer.decode] -= transfer.params.max_tokens - 1
            req = self._landed(transfer, host.allocate(num_pages))
            engine.runner.prepaid_host_pages.update(req.host_pages)
            engine.requests[req.request_id] = req
            engine.scheduler.add(req)

    @staticmethod
    def _landed(transfer: KVTransfer, host_pages: list[int]) -> Request:
        """The request as the decode engine takes it: swapped out (its prompt's KV in `host_pages`), the first
        token received at the transfer's arrival."""
        out, p = transfer.output, transfer.params
        m = out.metrics
        extra = transfer.extra
        req = Request(out.request_id, out.prompt_token_ids, p, m.arrival_time, p.seed or 0, 0,
                      extra.get("priority", 0), extra.get("tenant", "default"), extra.get("deadline"))  # fmt: skip
        req.append_token(out.outputs[0].token_ids[0])
        req.num_computed_tokens = req.num_prompt_tokens
        req.host_pages = host_pages
        req.metrics = RequestMetrics(
            m.arrival_time,
            first_scheduled_time=m.first_scheduled_time,
            first_token_time=transfer.arrival,
            token_times=[transfer.arrival],
            num_preemptions=m.num_preemptions,
        )
        return req

    def abort_all(self) -> None:
        """Abort every unfinished request: on its engine, or on the link (its first token kept); the abort outputs
        come with the next step."""
        super().abort_all()
        for t in self._blocked + [t for _, _, t in self._in_flight]:
            out = t.output
            comp = CompletionOutput.received(0, list(out.outputs[0].token_ids), 1, 0, "abort")
            self._outputs.append(RequestOutput(t.request_id, out.prompt_token_ids, [comp], True, out.metrics))
        self._in_flight, self._blocked = [], []
        self._owed = [0] * len(self.decode)

    def link_summary(self) -> dict:
        """What the links carried: transfers, bytes, each link's seconds on the wire, and per transfer the mean wait
        for its link and the mean time from the first token to the KV's arrival (wait + wire + latency)."""
        waits = [t.start - t.ready for t in self.transfers]
        times = [t.arrival - t.ready for t in self.transfers]
        return {
            "link": self.link.to_dict(),
            "num_transfers": len(self.transfers),
            "bytes": sum(t.nbytes for t in self.transfers),
            "busy_s": [q.busy_s for q in self.links],
            "mean_wait_s": sum(waits) / len(waits) if waits else 0.0,
            "mean_transfer_s": sum(times) / len(times) if times else 0.0,
        }
