"""HostTimers: the serving thread's CPU time per engine step, split into its parts.

Wraps an engine's own methods (the scheduler's schedule and update, the runner's packer, program call and fetch,
and the engine's step) with thread-CPU timers (`time.thread_time`), so a benchmark can say where the host's work
goes inside a real run. CPU time, not wall time: on a CPU "device" the host and the step's compute threads share
the cores, so the CPU the host uses is what it takes from the step (and inside a run it is several times what the
same work costs alone: cold caches). `fetch` includes whatever CPU the wait for the device itself burns.

For a single engine on the real runner (not the simulator, not a data-parallel router).
"""

import time

PARTS = ("schedule", "pack", "launch", "fetch", "update")


class HostTimers:
    def __init__(self, engine):
        self.cpu_s = dict.fromkeys((*PARTS, "step"), 0.0)
        sched, runner = engine.scheduler, engine.runner
        for obj, name, part in (
            (sched, "schedule", "schedule"),
            (sched, "update", "update"),
            (runner.packer, "pack", "pack"),
            (runner, "_run", "launch"),
            (runner, "fetch", "fetch"),
            (engine, "step", "step"),
        ):
            setattr(obj, name, self._timed(getattr(obj, name), part))

    def _timed(self, f, part: str):
        cpu = self.cpu_s

        def timed(*args, **kwargs):
            t0 = time.thread_time()
            try:
                return f(*args, **kwargs)
            finally:
                cpu[part] += time.thread_time() - t0

        return timed

    def reset(self) -> None:
        for k in self.cpu_s:
            self.cpu_s[k] = 0.0

    def per_step_ms(self, num_steps: int) -> dict[str, float]:
        """Milliseconds of host CPU per dispatched step: each part, `other` (the rest of the engine's step: outputs,
        step records) and `total`."""
        c, n = self.cpu_s, max(num_steps, 1)
        out = {p: 1e3 * c[p] / n for p in PARTS}
        out["other"] = 1e3 * (c["step"] - sum(c[p] for p in PARTS)) / n
        out["total"] = 1e3 * c["step"] / n
        return {k: round(v, 3) for k, v in out.items()}
