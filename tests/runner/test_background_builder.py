"""The process's one background builder of step programs (cbjax/runner/compilation/program_family.py): every
family's programs on one thread, smallest bucket first across families, at a lowered OS priority; a family's
`wait` returns with all of its programs built, each built once."""

import os
import sys
import threading

from cbjax.runner.compilation.counter import CompileCounter
from cbjax.runner.compilation.program_family import BACKGROUND_NICE, ProgramFamily, join_background


class Recorder:
    """A family's build function that records what it built, where, and at which priority."""

    def __init__(self, name: str, builds: list, gate: threading.Event):
        self.name, self.builds, self.gate = name, builds, gate

    def __call__(self, T: int):
        self.gate.wait()  # every family is queued before the first build starts
        nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) if sys.platform == "linux" else None
        self.builds.append((T, self.name, threading.current_thread().name, nice))
        return (self.name, T)


def family(name: str, buckets, builds: list, gate: threading.Event) -> ProgramFamily:
    # Keys unique to this test: programs are shared by key across the process.
    key = lambda T: ("test_background", name, T)
    return ProgramFamily(buckets, Recorder(name, builds, gate), key, CompileCounter())


def test_one_thread_builds_every_family_smallest_bucket_first_at_a_lower_priority():
    builds, gate = [], threading.Event()
    # The builder may take plain's smallest program as soon as plain is queued: it is the smallest of all.
    plain = family("plain", [8, 64, 32], builds, gate)
    blocks = family("blocks", [16, 48], builds, gate)
    plain.start_background()
    blocks.start_background()
    plain.start_background()  # queued once only
    gate.set()
    join_background()
    assert sorted(builds) == sorted(set(builds)) and len(builds) == 5  # each program built once
    order = [(T, name) for T, name, _, _ in builds]
    assert order == [(8, "plain"), (16, "blocks"), (32, "plain"), (48, "blocks"), (64, "plain")]
    assert {thread for _, _, thread, _ in builds} == {"cbjax-compile"}
    if sys.platform == "linux":
        main_nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        assert {nice for *_, nice in builds} == {min(19, main_nice + BACKGROUND_NICE)}
    assert plain.get(32) == ("plain", 32) and plain.num_ready == 3 and blocks.num_ready == 2


def test_wait_builds_what_the_builder_has_not_reached_on_the_calling_thread():
    builds, gate = [], threading.Event()
    plain = family("plain-wait", [16, 32], builds, gate)
    gate.set()
    plain.wait()  # never queued: everything builds here
    assert [(T, thread) for T, _, thread, _ in builds] == [(16, "MainThread"), (32, "MainThread")]
