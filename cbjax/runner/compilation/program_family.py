"""The compiled step program of each token bucket: built ahead of time, in the background or on demand.

A program is built by tracing and lowering the step (Python, holds the GIL) and compiling it with XLA (releases
the GIL; served by the persistent compilation cache when it has it, see jax_cache.py). Building every bucket
before the first step cost ~40 s on 2 cores, so the engine by default builds them in a background thread,
smallest first, while it already serves: a step whose program is not built yet builds it at once on its own
thread (it does not wait behind the queue), and waits only for a program already being built.

Programs are shared by every runner of the process with the same model, shapes and options (`ProgramKey`): a
second engine builds nothing.
"""

import atexit
import concurrent.futures
import threading
from collections.abc import Callable, Hashable, Sequence

from cbjax.runner.compilation.counter import CompileCounter

# Built programs and programs being built, by key, for the whole process (jit's own cache plays this role for
# jitted calls; ahead-of-time compiled programs bypass it).
_SHARED: dict[Hashable, concurrent.futures.Future] = {}
_SHARED_LOCK = threading.Lock()

# Background builders stop at interpreter exit: a daemon thread still inside XLA when the process tears down
# aborts it ("terminate called ... exception not rethrown"), so exit waits for the program being built, not the rest.
_EXITING = threading.Event()
_BACKGROUND: list[threading.Thread] = []


@atexit.register
def _stop_background_builds() -> None:
    _EXITING.set()
    for thread in _BACKGROUND:
        thread.join()


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
        self._background: threading.Thread | None = None

    def get(self, T: int):
        """Bucket T's program: built already, waited for if another thread builds it, else built now."""
        program = self._ready.get(T)
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
        """Build every bucket's program in a background thread, smallest first (decode steps use the small ones)."""
        if self._background is None:
            self._background = threading.Thread(target=self._build_quietly, name="cbjax-compile", daemon=True)
            _BACKGROUND[:] = [t for t in _BACKGROUND if t.is_alive()] + [self._background]  # finished: dropped
            self._background.start()

    def _build_quietly(self) -> None:
        for T in self.buckets:
            if _EXITING.is_set():
                return
            try:
                self.get(T)
            except Exception:  # the step that needs this bucket builds it again and raises
                continue

    def wait(self) -> None:
        """Until every bucket's program is built (the background thread's work, if any, included)."""
        if self._background is not None:
            self._background.join()
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


def clear_shared_programs() -> None:
    """Forget every program built in this process (tests that count a cold start's compiles)."""
    with _SHARED_LOCK:
        _SHARED.clear()
