"""Counting XLA compiles (and persistent-cache hits) per owner, through jax.monitoring events.

jit keeps one cache per function for the whole process, so runners of identical models share their compiled
programs; what a runner wants to know is whether *its* calls compiled anything. A `CompileCounter` counts the
compile events that happen inside its `counting()` blocks, on the thread that runs them.
"""

import contextlib
import threading

from jax import monitoring

# Recorded by jax around every backend compile of a lowered program, persistent-cache hits included.
_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
_CACHE_HIT = "/jax/compilation_cache/cache_hits"

_active = threading.local()  # .counters: the CompileCounters whose counting() block is open on this thread


def _counters() -> list:
    return getattr(_active, "counters", ())


def _on_duration(event: str, duration: float, **kwargs) -> None:
    if event == _BACKEND_COMPILE:
        for c in _counters():
            with c.lock:  # a background thread may count for the same owner
                c.num_compiles += 1
                c.compile_s += duration


def _on_event(event: str, **kwargs) -> None:
    if event == _CACHE_HIT:
        for c in _counters():
            with c.lock:
                c.num_cache_hits += 1


monitoring.register_event_duration_secs_listener(_on_duration)
monitoring.register_event_listener(_on_event)


class CompileCounter:
    """Compiles seen inside `counting()`: programs built (`num_compiles`, persistent-cache hits included), how
    many of those the persistent compilation cache served (`num_cache_hits`), and the seconds they took; plus the
    compiled programs loaded from disk without any compile (`num_loaded`, see program_store.py)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.num_compiles = 0
        self.num_cache_hits = 0
        self.compile_s = 0.0
        self.num_loaded = 0

    def count_loaded(self) -> None:
        with self.lock:
            self.num_loaded += 1

    @contextlib.contextmanager
    def counting(self):
        if not hasattr(_active, "counters"):
            _active.counters = []
        _active.counters.append(self)
        try:
            yield self
        finally:
            _active.counters.remove(self)
