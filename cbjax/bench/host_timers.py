"""HostTimers: the serving thread's CPU time per engine step, split into its parts.

Installs one thread-CPU timer (`time.thread_time`) through the `timed` hooks of the engine (its step, the
scheduler's schedule and update, building the step's outputs) and of its runner (packing the step's input, the
program call, fetch: see cbjax.runner.model_runner.ModelRunner), so a benchmark can say where the host's work goes
inside a real run. Nothing the engine computes changes. CPU time, not wall time: on a CPU "device" the host and the
step's compute threads share the cores, so the CPU the host uses is what it takes from the step (and inside a run
it is several times what the same work costs alone: cold caches). `fetch` includes whatever CPU the wait for the
device itself burns.

For a single engine on the real runner (not the simulator, not a data-parallel router).
"""

import time

PARTS = ("schedule", "pack", "launch", "fetch", "update", "outputs")


class _Timed:
    """A context manager adding the thread CPU time spent inside it to one part's total."""

    __slots__ = ("cpu_s", "part", "t0")

    def __init__(self, cpu_s: dict[str, float], part: str):
        self.cpu_s, self.part = cpu_s, part

    def __enter__(self):
        self.t0 = time.thread_time()

    def __exit__(self, *exc_info):
        self.cpu_s[self.part] += time.thread_time() - self.t0


class HostTimers:
    """Times `engine`'s host work by part from now on (its hooks stay installed; `reset` zeroes the totals)."""

    def __init__(self, engine):
        self.cpu_s = dict.fromkeys((*PARTS, "step"), 0.0)
        engine.timed = engine.runner.timed = self.timed

    def timed(self, part: str) -> _Timed:
        """The hooks' context-manager factory: one timer around one run of `part`."""
        return _Timed(self.cpu_s, part)

    def reset(self) -> None:
        for k in self.cpu_s:
            self.cpu_s[k] = 0.0

    def per_step_ms(self, num_steps: int) -> dict[str, float]:
        """Milliseconds of host CPU per dispatched step: each part, `other` (the rest of the engine's step: step
        records, stop strings, bookkeeping) and `total`."""
        c, n = self.cpu_s, max(num_steps, 1)
        out = {p: 1e3 * c[p] / n for p in PARTS}
        out["other"] = 1e3 * (c["step"] - sum(c[p] for p in PARTS)) / n
        out["total"] = 1e3 * c["step"] / n
        return {k: round(v, 3) for k, v in out.items()}
