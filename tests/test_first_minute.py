"""experiments/first_minute.py's repeats (their order and their summary) and the measurement lock it holds per run
(experiments/measurement_lock.py); no engine, no timing."""

import fcntl
import math

import pytest

from experiments.first_minute import schedule, summary
from experiments.measurement_lock import held


def test_repeats_interleave_every_method_and_tree():
    assert schedule(["ngram", "draft"], ["this", "before"], 2) == [
        (1, "ngram", "this"),
        (1, "ngram", "before"),
        (1, "draft", "this"),
        (1, "draft", "before"),
        (2, "ngram", "this"),
        (2, "ngram", "before"),
        (2, "draft", "this"),
        (2, "draft", "before"),
    ]


def run(method, value, tree="this"):
    return {"method": method, "tree": tree, "first_vs_steady": value}


def test_summary_gives_each_method_its_median_and_interval():
    runs = [run("ngram", 0.80), run("draft", 0.70), run("ngram", 0.90), run("draft", 0.75), run("ngram", 0.85)]
    ngram, draft = summary(runs)
    assert (ngram["method"], draft["method"]) == ("ngram", "draft")
    assert ngram["first_vs_steady"] == pytest.approx(0.85) and ngram["runs"] == [0.80, 0.90, 0.85]
    low, high = ngram["interval"]
    assert 0.80 <= low <= 0.85 <= high <= 0.90
    assert ngram["text"].startswith("0.85 [")
    assert draft["first_vs_steady"] == pytest.approx(0.725)


def test_summary_keeps_trees_apart_and_a_single_run_has_no_interval():
    this, before = summary([run("ngram", 0.8), run("ngram", 0.5, tree="before")])
    assert (this["tree"], this["first_vs_steady"]) == ("this", 0.8)
    assert (before["tree"], before["first_vs_steady"]) == ("before", 0.5)
    assert all(math.isnan(x) for x in this["interval"]) and this["text"] == "0.80"


def try_lock(path) -> bool:
    """Whether another open file description could take the lock now."""
    with open(path, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        fcntl.flock(f, fcntl.LOCK_UN)
        return True


def test_the_lock_is_held_inside_the_block_only(tmp_path):
    path = str(tmp_path / "cpu.lock")
    with held(path):
        assert not try_lock(path)
    assert try_lock(path)


def test_the_lock_is_released_when_the_run_fails(tmp_path):
    path = str(tmp_path / "cpu.lock")
    with pytest.raises(RuntimeError), held(path):
        raise RuntimeError("a run that failed")
    assert try_lock(path)
