"""DataParallelEngine: M engine replicas, each with its own scheduler, KV pool and device, behind LLMEngine's API.

A router (cbjax/core/routers.py) sends each new request to one replica; `step()` steps every replica that has work
and returns all their outputs. Each replica dispatches its step asynchronously (jax's dispatch returns before the
device finishes), so replicas on different devices run their steps at the same time while this one Python thread
goes round them. Replica i runs on jax.devices()[i % device_count]. On a CPU host,
`XLA_FLAGS=--xla_force_host_platform_device_count=N` makes N fake devices: a functional check (they share the
same cores), not a speed one.

Not done yet (issue 15): tensor parallelism, multi-host, and the experiment harness driving a DataParallelEngine
(routers compared like policies).
"""

import collections
from collections.abc import Iterator

import jax

from cbjax.config import validation as check
from cbjax.core.clock import Clock, RealClock
from cbjax.core.engine_wrappers import engines_switch, engines_total
from cbjax.core.outputs import RequestOutput
from cbjax.core.routers import make_router
from cbjax.core.sampling_params import SamplingParams
from cbjax.engine import LLMEngine


def owed_tokens(engine: LLMEngine) -> int:
    """Tokens an engine still owes its unfinished requests: prompt tokens to compute + outputs to generate (the load
    a router reads)."""
    return sum(
        max(0, req.num_prompt_tokens - req.num_computed_tokens) + req.params.max_tokens - len(req.output_token_ids)
        for req in engine.requests.values()
        if not req.is_finished
    )


class DataParallelEngine:
    """`data_parallel_size` LLMEngine replicas of `model` (the same weights) sharing one clock. Engine options are
    LLMEngine's and apply to every replica (so `num_pages` is per replica). `router`: a name in ROUTERS
    (round_robin, least_load, prefix_affinity), `router_options` its constructor options."""

    def __init__(
        self,
        model=None,
        *,
        data_parallel_size: int = 2,
        router: str = "least_load",
        router_options: dict | None = None,
        clock: Clock | None = None,
        **options,
    ):
        size = check.integer("data_parallel_size", data_parallel_size, 1)
        self.router = make_router(router, router_options)  # checked before anything is built
        self.clock = clock or RealClock()
        devices = jax.devices()
        self.replicas = [
            LLMEngine(model, clock=self.clock, device=devices[i % len(devices)], **options) for i in range(size)
        ]
        first = self.replicas[0]
        self.config, self.model_config, self.tokenizer = first.config, first.model_config, first.tokenizer
        self._owner: dict[str, int] = {}  # unfinished request id -> its replica
        self.num_routed = [0] * size  # requests each replica was given

    stream_outputs = engines_switch("replicas", "stream_outputs", "As LLMEngine.stream_outputs, for every replica.")
    stream_rows = engines_switch("replicas", "stream_rows", "As LLMEngine.stream_rows, for every replica.")

    @property
    def requests(self) -> collections.ChainMap:
        """Every replica's unfinished requests by id (read-only view)."""
        return collections.ChainMap(*(r.requests for r in self.replicas))

    def load(self) -> list[int]:
        """Tokens each replica still owes its unfinished requests (owed_tokens)."""
        return [owed_tokens(replica) for replica in self.replicas]

    def add_request(
        self, request_id: str, prompt, params: SamplingParams | None = None, arrival_time=None, **kwargs
    ) -> None:
        """As LLMEngine.add_request; the router picks the replica. Request ids are unique across replicas."""
        if isinstance(request_id, str) and request_id in self._owner:
            raise ValueError(f"request {request_id!r}: duplicate request id (a request with this id is unfinished)")
        i = self.router.choose(self._route_key(prompt), self.load())
        self.replicas[i].add_request(request_id, prompt, params, arrival_time, **kwargs)
        self._owner[request_id] = i
        self.num_routed[i] += 1

    def _route_key(self, prompt) -> list[int]:
        """The prompt's token ids for the router (a prompt the replica will refuse routes anywhere)."""
        if isinstance(prompt, str) and self.tokenizer is not None:
            return self.tokenizer.encode(prompt)
        try:
            return check.token_ids("prompt", prompt)
        except ValueError:
            return []

    def abort_request(self, request_id: str) -> None:
        i = self._owner.get(request_id) if isinstance(request_id, str) else None
        if i is None:
            raise ValueError(f"abort of unknown request id {request_id!r}")
        self.replicas[i].abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return any(r.has_unfinished_requests() for r in self.replicas)

    def next_event_time(self) -> float | None:
        times = [t for r in self.replicas if (t := r.next_event_time()) is not None]
        return min(times) if times else None

    @property
    def advances_clock(self) -> bool:
        return self.replicas[0].advances_clock

    num_steps = engines_total("replicas", "num_steps", "Steps dispatched, summed over the engines.")
    num_rows_received = engines_total("replicas", "num_rows_received", "As LLMEngine.num_rows_received, summed.")

    @property
    def buckets(self):
        return self.replicas[0].buckets

    @property
    def after_execute(self):
        return self.replicas[0].after_execute

    @after_execute.setter
    def after_execute(self, hook) -> None:
        # A virtual clock advances after each replica's step: replicas stepped in turn by one thread (and, on fake
        # devices, sharing the same cores) take the sum of their step times.
        for r in self.replicas:
            r.after_execute = hook

    def step(self) -> list[RequestOutput]:
        """One step of every replica that has work (each dispatches before it waits for its previous step)."""
        outputs = []
        for replica in self.replicas:
            if replica.has_unfinished_requests():
                outputs += replica.step()
        for out in outputs:
            if out.finished:
                self._owner.pop(out.request_id, None)
        return outputs

    def stream(self) -> Iterator[RequestOutput]:
        while self.has_unfinished_requests():
            yield from self.step()

    @property
    def num_compiles(self) -> int:
        return sum(r.num_compiles for r in self.replicas)

    @property
    def warmup_s(self) -> float:
        """Seconds the replicas' constructors spent building step programs (they share compiled programs)."""
        return sum(r.warmup_s for r in self.replicas)

    @property
    def step_records(self) -> list[dict]:
        """Every replica's step records, each with its replica's index."""
        return [{**rec, "replica": i} for i, r in enumerate(self.replicas) for rec in r.step_records]

    def wait_until_warm(self) -> None:
        for r in self.replicas:
            r.wait_until_warm()

    def abort_all(self) -> None:
        for r in self.replicas:
            r.abort_all()
