"""Pacing the background builder while the engine serves: build at most a fixed share of the time.

A background build takes the cores from the steps served beside it, whatever the builder thread's OS priority:
XLA compiles on its own worker threads, made at the served steps' priority (not the builder's), and tracing holds
the GIL. Measured with experiments/first_minute.py (tinypy, n-gram speculation, batch 1, 2 cores): calls served
while a program built ran at ~0.6 of steady state, even with the builder at nice +10; two native threads at nice 0
did most of each compile. So while steps are served, the builder pauses after each program for a multiple of the
time it took (`duty`: the share of the time it builds); when nothing was served for `window_s` (an idle engine, a
warmup) it builds without pausing. A step whose program is missing still builds it at once on its own thread
(ProgramFamily.get), and `wait_until_warm` builds what is left on the caller's thread, so pacing delays only the
programs nobody has asked for yet.
"""

import threading
import time


class BuildPacer:
    """When the background builder should pause. `note_demand()` from a serving thread (every step asks its
    family for a program); `pause_s(build_s)` after each background build; `hurry()` ends the pauses (someone waits
    for the builder to finish)."""

    def __init__(self, duty: float = 0.25, window_s: float = 1.0, clock=time.monotonic):
        if not 0.0 < duty <= 1.0:
            raise ValueError(f"duty must be in (0, 1], got {duty}")
        if window_s < 0:
            raise ValueError(f"window_s must be >= 0, got {window_s}")
        self.duty, self.window_s, self._clock = duty, window_s, clock
        self._last_demand: float | None = None
        self._hurry = threading.Event()

    @property
    def last_demand(self) -> float | None:
        """The clock's time of the last `note_demand()` (None: never)."""
        return self._last_demand

    def note_demand(self) -> None:
        self._last_demand = self._clock()

    def serving(self) -> bool:
        """Was a program asked for by a serving thread within the last `window_s`?"""
        return self._last_demand is not None and self._clock() - self._last_demand <= self.window_s

    def pause_s(self, build_s: float) -> float:
        """How long to pause after a background build of `build_s` seconds: enough that building takes `duty` of
        the time while steps are served; 0 when none are, or when hurried."""
        if self._hurry.is_set() or not self.serving():
            return 0.0
        return build_s * (1.0 - self.duty) / self.duty

    def pause(self, build_s: float) -> None:
        """Pause (releasing the GIL) for `pause_s(build_s)`, cut short by `hurry()`."""
        seconds = self.pause_s(build_s)
        if seconds > 0:
            self._hurry.wait(seconds)

    def hurry(self) -> None:
        self._hurry.set()

    def unhurry(self) -> None:
        self._hurry.clear()
