"""Every runner keeps the written contract of cbjax/core/runner_contract.py: the methods and attributes the engine
calls, with the contract's parameters, and the behaviour the contract promises that can be checked without a
workload (warmup's modes, a swap's byte counts, a step's handle and its tokens)."""

import inspect

import pytest

from cbjax.core.runner_contract import WARMUP_MODES, Runner, StepHandle
from cbjax.core.scheduler_output import SchedulerOutput
from cbjax.engine import LLMEngine
from tests.core.fake_runner import FakeRunner
from tests.core.scheduler_setup import FlatConfig, make_scheduler

MODEL_OPTIONS = dict(max_num_seqs=2, max_num_batched_tokens=32, page_size=8, num_pages=16, warmup="none")


@pytest.fixture(scope="module")
def runners():
    """One of each kind: the model runner (test-tiny, nothing compiled here), the simulator's, the tests' fake."""
    model = LLMEngine("test-tiny", preemption_mode="swap", num_host_pages=4, **MODEL_OPTIONS).runner
    sim = LLMEngine("llama-tiny", runner="sim", sim_accelerator="h200", **MODEL_OPTIONS).runner
    fake = FakeRunner(make_scheduler(FlatConfig(page_size=8, num_pages=16), clock=None), vocab_size=7)
    return {"model": model, "sim": sim, "fake": fake}


KINDS = ("model", "sim", "fake")


def _contract_methods():
    return {
        name: member
        for name, member in vars(Runner).items()
        if not name.startswith("_") and (inspect.isfunction(member) or isinstance(member, property))
    }


@pytest.mark.parametrize("kind", KINDS)
def test_each_runner_has_every_method_and_attribute_of_the_contract(runners, kind):
    runner = runners[kind]
    assert isinstance(runner, Runner)  # runtime_checkable: every member is there
    for name in Runner.__annotations__:
        assert hasattr(runner, name), name
    assert isinstance(runner.advances_clock, bool)
    assert runner.advances_clock is (kind == "sim")
    assert isinstance(runner.num_compiles, int)
    for name, member in _contract_methods().items():
        if isinstance(member, property):
            continue
        wanted = list(inspect.signature(member).parameters)[1:]
        got = list(inspect.signature(getattr(runner, name)).parameters)
        assert got == wanted, f"{kind}.{name}{got} differs from the contract's {wanted}"


@pytest.mark.parametrize("kind", KINDS)
def test_warmup_takes_the_contract_modes_and_refuses_others(runners, kind):
    runner = runners[kind]
    assert runner.warmup("none") >= 0.0
    with pytest.raises(ValueError, match="warmup"):
        runner.warmup("eventually")
    assert set(WARMUP_MODES) == {"background", "full", "none"}


@pytest.mark.parametrize("kind", KINDS)
def test_a_swap_only_step_moves_pages_and_returns_a_handle(runners, kind):
    runner = runners[kind]
    before = runner.swap_out_bytes_total
    out = SchedulerOutput([], 0, [], 0.0, swap_out=[(0, 0)])
    handle = runner.dispatch(out)
    for name in StepHandle.__annotations__:
        assert hasattr(handle, name), name
    assert handle.out is out and handle.swap_out_bytes > 0
    assert runner.swap_out_bytes_total == before + handle.swap_out_bytes
    assert len(runner.fetch(handle)) == 0  # no sequence: no token
    runner.swap([], [(0, 0)])  # and back
