"""The background builder's pacing (cbjax/runner/compilation/build_pacing.py): while steps are served it builds a
fixed share of the time, otherwise without pause; a serving thread's request for a program counts as serving, the
builder's own builds do not."""

import threading

import pytest

from cbjax.runner.compilation.build_pacing import BuildPacer
from cbjax.runner.compilation.counter import CompileCounter
from cbjax.runner.compilation.program_family import (
    BACKGROUND_DUTY,
    DUTY_ENV_VAR,
    ProgramFamily,
    background_duty,
    background_pacer,
    join_background,
)


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_pauses_to_keep_the_duty_share_only_while_serving():
    clock = FakeClock()
    pacer = BuildPacer(duty=0.25, window_s=1.0, clock=clock)
    assert pacer.pause_s(2.0) == 0.0  # nothing served yet: build flat out
    pacer.note_demand()
    clock.now += 0.5
    assert pacer.serving() and pacer.pause_s(2.0) == pytest.approx(6.0)  # builds 2 s of every 8
    clock.now += 1.0  # idle for longer than the window
    assert not pacer.serving() and pacer.pause_s(2.0) == 0.0
    pacer.note_demand()
    pacer.hurry()  # someone waits for the builder: no more pauses
    assert pacer.pause_s(2.0) == 0.0
    pacer.unhurry()
    assert pacer.pause_s(2.0) == pytest.approx(6.0)
    assert BuildPacer(duty=1.0, clock=clock).pause_s(2.0) == 0.0  # duty 1: never pauses


@pytest.mark.parametrize("kwargs", [{"duty": 0.0}, {"duty": 1.5}, {"window_s": -1.0}])
def test_bad_pacing_is_refused(kwargs):
    with pytest.raises(ValueError):
        BuildPacer(**kwargs)


def test_a_serving_threads_request_notes_demand_the_builders_own_builds_do_not():
    pacer = background_pacer()
    built = []
    fam = ProgramFamily([8, 16], lambda T: built.append(T) or T, lambda T: ("test_build_pacing", T), CompileCounter())
    before = pacer.last_demand
    fam.start_background()
    join_background()
    assert sorted(built) == [8, 16] and pacer.last_demand == before  # the builder's gets
    assert threading.current_thread() is threading.main_thread()
    assert fam.get(8) == 8 and pacer.last_demand is not None and pacer.last_demand != before


def test_background_duty_reads_the_environment(monkeypatch):
    monkeypatch.delenv(DUTY_ENV_VAR, raising=False)
    assert background_duty() == BACKGROUND_DUTY
    monkeypatch.setenv(DUTY_ENV_VAR, "0.5")
    assert background_duty() == 0.5
    monkeypatch.setenv(DUTY_ENV_VAR, "fast")
    with pytest.raises(ValueError, match=DUTY_ENV_VAR):
        background_duty()
    monkeypatch.setenv(DUTY_ENV_VAR, "0")
    with pytest.raises(ValueError, match="duty"):  # out of (0, 1]: the pacer refuses it
        BuildPacer(background_duty())
