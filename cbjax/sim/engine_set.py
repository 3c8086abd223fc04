"""Several simulated engines, each on its own clock, stepped in time order behind one engine-like API; and the
simplest such set, ReplicatedSim: data-parallel replicas behind a router (the colocated baseline of the
disaggregated simulator, cbjax/sim/disaggregated.py).

The engines are simulated LLMEngines (runner="sim"), built by the caller (this package imports no engine: it must
not import jax), each with its own VirtualClock: engine i's clock is when it next schedules a step (a step's cost
moves it, in its SimRunner). `step` runs one step of the busy engine whose clock is earliest, so every engine sees
arrivals and the other engines' events in time order. `self.clock` is the run's clock, which cbjax.bench.online
reads to hand over arrivals: it follows the earliest busy engine. When that engine is ahead of it, `step` runs
nothing and `next_event_time` says when, so run_online first hands over the requests that arrived meanwhile. An idle
engine given work starts at the run's time (its clock waited at the end of its last step).
"""

from cbjax.core.clock import VirtualClock
from cbjax.core.engine_wrappers import engines_switch, engines_total
from cbjax.core.routers import make_router
from cbjax.core.sampling_params import SamplingParams
from cbjax.sim.sim_runner import SimRunner


def owed_tokens(engine) -> int:
    """Tokens an engine still owes its unfinished requests: prompt tokens to compute + outputs to generate (the
    load a router reads, as DataParallelEngine.load)."""
    return sum(
        max(0, r.num_prompt_tokens - r.num_computed_tokens) + r.params.max_tokens - len(r.output_token_ids)
        for r in engine.requests.values()
        if not r.is_finished
    )


class SimulatedEngines:
    """The time-ordered stepping of `engines` (simulated LLMEngines, each on its own VirtualClock). Subclasses
    route requests (`add_request`) and may hold work between engines (`_between`, `_pending`, `_event_times`)."""

    advances_clock = True  # cbjax.bench.online leaves the clock to the engines' runners

    def __init__(self, engines: list):
        clocks = [e.clock for e in engines]
        for i, e in enumerate(engines):
            if not isinstance(e.runner, SimRunner) or not isinstance(e.clock, VirtualClock):
                raise ValueError(f"engine {i}: simulated engines only (runner='sim', on a VirtualClock)")
            if any(c is e.clock for c in clocks[:i]):
                raise ValueError(f"engine {i} shares a clock with another: each engine needs its own VirtualClock")
        self.engines = list(engines)  # step records' `replica` is the index here
        self.clock = VirtualClock(max(c.now() for c in clocks))
        self.after_execute = None  # (run_online sets and clears it; the runners move the clocks)
        self._outputs: list = []  # outputs made outside a step (aborts), returned by the next one

    def _busy(self) -> list:
        return [e for e in self.engines if e.has_unfinished_requests()]

    def _wake(self, engine, t: float | None = None) -> None:
        """An idle engine given work at `t` (default: now) starts then."""
        t = self.clock.now() if t is None else t
        if not engine.has_unfinished_requests() and engine.clock.now() < t:
            engine.clock.set(t)

    # ---- hooks ----------------------------------------------------------------------------------------------------
    def _pending(self) -> bool:
        """Whether work is held between engines (none here)."""
        return False

    def _event_times(self) -> list[float]:
        """When work held between engines next moves on (none here)."""
        return []

    def _between(self, until: float) -> None:
        """Move on the work held between engines that is due by `until` (the earliest busy engine's clock)."""

    def _stepped(self, engine, outputs: list) -> list:
        """What `engine`'s step returned, as this set's outputs."""
        return outputs

    # ---- the engine-like API --------------------------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return bool(self._outputs) or self._pending() or any(e.has_unfinished_requests() for e in self.engines)

    def next_event_time(self) -> float | None:
        """The earliest of: a busy engine's next step, work between engines moving on, a policy's timeout."""
        times = [e.clock.now() for e in self._busy()] + self._event_times()
        times += [t for e in self.engines if (t := e.next_event_time()) is not None]
        return min(times) if times else None

    def step(self) -> list:
        """One step of the engine whose clock is earliest (after moving on what is due between engines), unless
        that is later than self.clock: then nothing runs (next_event_time() is that time). Returns its outputs."""
        outputs, self._outputs = self._outputs, []
        busy = self._busy()
        self._between(min(e.clock.now() for e in busy) if busy else self.clock.now())
        busy = self._busy()
        if not busy:
            return outputs
        engine = min(busy, key=lambda e: e.clock.now())
        t = engine.clock.now()
        if t > self.clock.now():
            return outputs
        steps, got = engine.num_steps, engine.step()
        if engine.num_steps == steps and not got and engine.clock.now() == t and engine.has_unfinished_requests():
            raise RuntimeError("a simulated engine has work but runs no step (a policy that waits, as static with a "
                               "timeout, is not supported)")  # fmt: skip
        return outputs + self._stepped(engine, got)

    num_steps = engines_total("engines", "num_steps", "Steps dispatched, summed over the engines.")
    num_rows_received = engines_total("engines", "num_rows_received", "As LLMEngine.num_rows_received, summed.")

    @property
    def step_records(self) -> list[dict]:
        """Every engine's step records (each on its own clock), `replica` its index, in time order."""
        records = [{**r, "replica": i} for i, e in enumerate(self.engines) for r in e.step_records]
        return sorted(records, key=lambda r: r["time"])

    def abort_all(self) -> None:
        """Abort every unfinished request; the abort outputs come with the next step."""
        for e in self.engines:
            e.abort_all()
            self._outputs += self._stepped(e, e.step())  # (its scheduler is empty now: this reports the aborts)


class ReplicatedSim(SimulatedEngines):
    """Data-parallel replicas, a router (cbjax/core/routers.py) choosing each request's: the colocated
    counterpart of DisaggregatedSim on the same number of devices."""

    def __init__(self, engines: list, *, router: str = "least_load"):
        if not engines:
            raise ValueError("ReplicatedSim needs >= 1 engine")
        super().__init__(engines)
        self.router = make_router(router)

    stream_outputs = engines_switch("engines", "stream_outputs", "As LLMEngine.stream_outputs, for every replica.")

    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None, arrival_time=None, **extra):
        """As LLMEngine.add_request; the router picks the replica."""
        if any(request_id in e.requests for e in self.engines):
            raise ValueError(f"request {request_id!r}: duplicate request id (a request with this id is unfinished)")
        engine = self.engines[self.router.choose(prompt, [owed_tokens(e) for e in self.engines])]
        self._wake(engine)
        engine.add_request(request_id, prompt, params, arrival_time, **extra)
