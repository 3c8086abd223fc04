"""The compiled step program of each token bucket: built ahead of time, in the background or on demand.

A program is built by tracing and lowering the step (Python, holds the GIL) and compiling it with XLA (releases
the GIL; served by the persistent compilation cache when it has it, see jax_cache.py). Building every bucket
before the first step cost ~40 s on 2 cores, so the engine by default builds them in the background while it
already serves: a step whose program is not built yet builds it at once on its own thread (it does not wait behind
the queue), and waits only for a program already being built.

One background builder serves every family of the process (plain steps, verify steps, blocks of decode steps, a
draft's prefills): one program at a time, the smallest bucket of any family first, on a thread of lowered OS
priority (nice +10, Linux). A thread per family built three or four programs at once on 2 cores, and they took
the cores from the steps being served (issue 37: calls right after construction ran at 0.30x with a draft model);
at a lower priority the builder gets what the served steps leave (experiments/first_minute.py measures it; the GIL,
which tracing holds, is still shared: a shorter thread switch interval while building did not clearly pay there).
XLA's compile runs on worker threads at the served steps' priority all the same, so while steps are served the
builder also pauses between programs, building a fixed share of the time (build_pacing.py).

Programs are shared by every runner of the process with the same model, shapes and options (`ProgramKey`): a
second engine builds nothing.
"""

import atexit
import concurrent.futures
import heapq
import itertools
import os
import threading
import time
from collections.abc import Callable, Hashable, Sequence

from cbjax.runner.compilation.build_pacing import BuildPacer
from cbjax.runner.compilation.counter import CompileCounter

# Built programs and programs being built, by key, for the whole process (jit's own cache plays this role for
# jitted calls; ahead-of-time compiled programs bypass it).
_SHARED: dict[Hashable, concurrent.futures.Future] = {}
_SHARED_LOCK = threading.Lock()

# The background builder stops at interpreter exit: a daemon thread still inside XLA when the process tears down
# aborts it ("terminate called ... exception not rethrown"), so exit waits for the program being built, not the rest.
_EXITING = threading.Event()
BACKGROUND_NICE = 10  # added to the builder thread's OS priority (Linux: a thread's nice is its own)
BACKGROUND_DUTY = 0.1  # the share of the time the builder builds while steps are served (build_pacing.py)
DUTY_ENV_VAR = "CBJAX_BACKGROUND_BUILD_DUTY"  # overrides it: a share in (0, 1] (1: no pacing)


def background_duty() -> float:
    """The builder's duty: $CBJAX_BACKGROUND_BUILD_DUTY if set, else BACKGROUND_DUTY."""
    value = os.environ.get(DUTY_ENV_VAR)
    if not value:
        return BACKGROUND_DUTY
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"{DUTY_ENV_VAR} must be a number in (0, 1], got {value!r}") from None


class _BackgroundBuilder:
    """The process's one background build queue: (bucket, order submitted, family), smallest bucket first. Its
    thread runs while the queue has work and ends when it is empty; the next `submit` starts a new one."""

    def __init__(self):
        self._queue: list[tuple[int, int, ProgramFamily]] = []
        self._order = itertools.count()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.pacer = BuildPacer(background_duty())

    def submit(self, family: "ProgramFamily") -> None:
        with self._lock:
            for T in family.buckets:
                heapq.heappush(self._queue, (T, next(self._order), family))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="cbjax-compile", daemon=True)
                self.pacer.unhurry()  # (a join() before this submit is over)
                self._thread.start()

    def _next(self) -> "tuple[int, ProgramFamily] | None":
        with self._lock:
            if not self._queue or _EXITING.is_set():
                self._thread = None
                return None
            T, _, family = heapq.heappop(self._queue)
            return T, family

    def on_builder_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def _run(self) -> None:
        _lower_priority()
        while (item := self._next()) is not None:
            T, family = item
            t0 = time.perf_counter()
            try:
                family.get(T)
            except Exception:  # the step that needs this bucket builds it again and raises
                continue
            self.pacer.pause(time.perf_counter() - t0)

    def join(self) -> None:
        """Until the queue is empty (or exit is under way) and the thread has ended (without pausing any more)."""
        self.pacer.hurry()
        while (thread := self._thread) is not None and thread.is_alive():
            thread.join()


def _lower_priority() -> None:
    """Lower the calling thread's OS priority by BACKGROUND_NICE, where the OS allows it (best effort)."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + BACKGROUND_NICE))
    except (AttributeError, OSError):  # not Linux/Unix, or not permitted: build at the same priority
        pass


_BUILDER = _BackgroundBuilder()


@atexit.register
def _stop_background_builds() -> None:
    _EXITING.set()
    _BUILDER.join()


class ProgramFamily:
    """One compiled program per token bucket. `build(T)` returns a compiled callable for bucket T (it traces,
    lowers and compiles); `key(T)` identifies that program within the process."""

    def __init__(
        self,
        buckets: Sequence[int],
        build: Callable[[int], object],
        key: Callable[[int], Hashable],
        compiles: CompileCounter,
    ):
        self.buckets = tuple(sorted(buckets))
        self._build = build
        self._key = key
        self._compiles = compiles
        self._ready: dict[int, object] = {}
        self._primed: set[int] = set()  # buckets whose program `prime` has run
        self._submitted = False  # queued on the background builder

    def get(self, T: int):
        """Bucket T's program: built already, waited for if another thread builds it, else built now."""
        program = self._ready.get(T)
        if not _BUILDER.on_builder_thread():  # a step (or a warmup) asks: the builder paces itself
            _BUILDER.pacer.note_demand()
        if program is None:
            program = self._ready[T] = self._claim_or_wait(T)
        return program

    def _claim_or_wait(self, T: int):
        key = self._key(T)
        with _SHARED_LOCK:
            future = _SHARED.get(key)
            mine = future is None
            if mine:
                future = _SHARED[key] = concurrent.futures.Future()
        if not mine:
            return future.result()
        try:
            with self._compiles.counting():
                program = self._build(T)
        except BaseException as e:
            with _SHARED_LOCK:
                del _SHARED[key]  # let a later call try again
            future.set_exception(e)
            raise
        future.set_result(program)
        return program

    def build_all(self) -> None:
        for T in self.buckets:
            self.get(T)

    def start_background(self) -> None:
        """Queue every bucket's program on the process's background builder (see the module docstring): smallest
        first, with the other families' (decode steps use the small ones)."""
        if not self._submitted:
            self._submitted = True
            _BUILDER.submit(self)

    def wait(self) -> None:
        """Until every bucket's program is built: a program the background builder is building is waited for, one
        it has not reached yet is built now, on this thread."""
        self.build_all()

    def prime(self, run: Callable[[int], object]) -> None:
        """Run each built program that has not run here yet once: `run(T)` executes bucket T's program (the caller
        feeds it an input whose results it may discard). See ModelRunner.prime for why."""
        for T in self.buckets:
            if T in self._ready and T not in self._primed:
                run(T)
                self._primed.add(T)

    @property
    def num_primed(self) -> int:
        return len(self._primed)

    @property
    def num_ready(self) -> int:
        return sum(1 for T in self.buckets if T in self._ready)


def join_background() -> None:
    """Until the background builder has built everything queued on it (tools and tests that want the builds to
    happen there, not on their own thread as `ProgramFamily.wait` does)."""
    _BUILDER.join()


def background_pacer() -> BuildPacer:
    """The background builder's pacer (build_pacing.py)."""
    return _BUILDER.pacer


def clear_shared_programs() -> None:
    """Forget every program built in this process (tests that count a cold start's compiles)."""
    with _SHARED_LOCK:
        _SHARED.clear()
