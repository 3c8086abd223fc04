"""The simulator makes the real engine's scheduling decisions: run a workload on the real engine (test-tiny) on a
virtual clock that advances by each step's measured wall time, record every scheduled batch and every step time,
then run the SimRunner with a cost model that replays those step times: the batches (which requests, how many
tokens, preemptions, swaps, at what time) must be identical, step for step."""

import numpy as np
import pytest

from cbjax import LLMEngine
from cbjax.bench.online import run_online
from cbjax.bench.requests import WorkloadRequest
from cbjax.core.clock import VirtualClock
from cbjax.model import get_model_config, init_model
from cbjax.sim import ReplayCost

OPTS = dict(
    max_num_seqs=6,
    max_num_batched_tokens=64,
    page_size=16,
    max_model_len=176,
    num_pages=16,  # 256 KV tokens for up to 6 sequences of up to 176: preemption under load
    watermark_fraction=0.0,
    warmup=False,
    dtype="float32",
)


class RecordingClock(VirtualClock):
    """A virtual clock that keeps every step's advance (run_online's measured step times)."""

    def __init__(self):
        super().__init__()
        self.advances: list[float] = []

    def advance(self, dt: float) -> None:
        self.advances.append(dt)
        super().advance(dt)


def record_batches(engine) -> list:
    """Wrap the engine's scheduler so every scheduled step is kept as plain data."""
    batches = []
    schedule = engine.scheduler.schedule

    def recording():
        out = schedule()
        batches.append(
            (
                out.time,
                tuple(
                    (s.request.request_id, s.num_computed_tokens, s.num_new_tokens, s.samples_token) for s in out.seqs
                ),
                tuple(r.request_id for r in out.preempted),
                tuple(out.swap_out),
                tuple(out.swap_in),
            )
        )
        return out

    engine.scheduler.schedule = recording
    return batches


@pytest.fixture(scope="module")
def model():
    return init_model(get_model_config("test-tiny"), seed=0)


@pytest.fixture(scope="module")
def workload():
    rng = np.random.default_rng(3)
    t, reqs = 0.0, []
    for i in range(20):
        t += float(rng.exponential(0.004))
        prompt = tuple(int(x) for x in rng.integers(3, 512, int(rng.integers(4, 100))))
        reqs.append(WorkloadRequest(str(i), t, prompt, int(rng.integers(10, 70)), priority=int(rng.integers(0, 3))))
    return reqs


CASES = [(p, "recompute") for p in ("fcfs", "sarathi", "priority", "mlfq", "static")] + [
    (p, "swap") for p in ("fcfs", "priority", "mlfq")
]


@pytest.mark.parametrize("policy,mode", CASES)
def test_the_simulator_schedules_exactly_as_the_real_engine(model, workload, policy, mode):
    opts = dict(OPTS, policy=policy, preemption_mode=mode, num_host_pages=64 if mode == "swap" else None)
    clock = RecordingClock()
    real = LLMEngine(model, clock=clock, **opts)
    real_batches = record_batches(real)
    real_result = run_online(real, workload)  # measured step times: they differ run to run
    sim = LLMEngine("test-tiny", cost_model=ReplayCost(clock.advances), runner="sim", **opts)
    sim_batches = record_batches(sim)
    sim_result = run_online(sim, workload)
    assert sim.model is None and sim.num_compiles == 0
    assert sim.runner.cost_model.num_used == len(clock.advances)  # every measured step replayed, no more
    assert len(sim_batches) == len(real_batches)
    for i, (a, b) in enumerate(zip(real_batches, sim_batches)):
        assert a == b, f"step {i} differs"
    assert [(r.request_id, r.output_len, r.first_token_time, r.finished_time) for r in sim_result.requests] == [
        (r.request_id, r.output_len, r.first_token_time, r.finished_time) for r in real_result.requests
    ]
    if policy != "static":  # the pool is small enough that the others preempt
        assert real.scheduler.num_preemptions > 0
    if mode == "swap" and policy == "fcfs":
        assert real.scheduler.num_swapped_out_pages > 0
