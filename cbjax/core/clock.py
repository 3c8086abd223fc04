"""Injected clocks: the engine and scheduler read time only through one of these, so tests and the simulator run
on virtual time and give reproducible results."""

import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float: ...


class RealClock:
    """Wall-clock seconds (monotonic, high resolution)."""

    def now(self) -> float:
        return time.perf_counter()


class VirtualClock:
    """A clock that only moves when told to: `advance(dt)` or `set(t)`."""

    def __init__(self, start: float = 0.0):
        self._t = float(start)

    def now(self) -> float:
        return self._t

    def advance(self, dt: float) -> None:
        if dt < 0:
            raise ValueError(f"VirtualClock cannot go backwards (dt={dt})")
        self._t += dt

    def set(self, t: float) -> None:
        if t < self._t:
            raise ValueError(f"VirtualClock cannot go backwards ({t} < {self._t})")
        self._t = float(t)
