"""The runner contract: what the engine asks of whatever runs its steps.

Three runners keep it: cbjax.runner.model_runner.ModelRunner (the model, jitted, on a device or a mesh),
cbjax.sim.sim_runner.SimRunner (a cost model on a virtual clock, no jax) and the test suite's FakeRunner (a pure
Python stand-in that makes scheduler bugs visible in the tokens, tests/core/fake_runner.py).
tests/test_runner_contract.py checks all three against it. The engine (cbjax/engine.py) calls only these, so a
new runner (another simulator, a remote device) needs nothing else.

A step's life on a runner: the Scheduler's `SchedulerOutput` goes to `dispatch`, which performs the step's KV swaps
(swap_out first, then swap_in, complete before it returns) and starts the forward pass without waiting for it; the
engine may then schedule and dispatch the next step (asynchronous scheduling: the pending tokens of a step are fed
to the next one by the runner itself) before it calls `fetch` on the older handle, which waits for the step and
returns its sampled tokens on the host. Handles are fetched in the order they were dispatched, each exactly once.

One optional extra: before dispatching a block of decode steps the engine sets `runner.stream_rows` (whether its
rows should stream: LLMEngine.stream_rows); a handle with a `stream_base` that is not None streams its rows, and the
engine then takes them one per step() through `runner.fetch_row(handle)` before `fetch` returns the rest
(ModelRunner on the CPU: cbjax/runner/token_stream.py). A runner whose handles have no `stream_base` needs neither.
"""

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from cbjax.config.compilation import WARMUP_MODES
from cbjax.core.scheduler_output import SchedulerOutput

__all__ = ["WARMUP_MODES", "Runner", "StepHandle", "check_warmup_mode"]


def check_warmup_mode(mode: str) -> str:
    """`mode` if it is one of WARMUP_MODES, else the ValueError every runner's `warmup` raises."""
    if mode not in WARMUP_MODES:
        raise ValueError(f"warmup must be one of {WARMUP_MODES}, got {mode!r}")
    return mode


class StepHandle(Protocol):
    """A dispatched step, as the engine reads it after `fetch`."""

    out: SchedulerOutput  # what was dispatched
    padded_tokens: int  # the token bucket the step ran in (0 for a swap-only step)
    swap_s: float  # real seconds the step's KV copies took (inside dispatch)
    swap_out_bytes: int
    swap_in_bytes: int
    wait_s: float  # real seconds `fetch` waited for the device


@runtime_checkable
class Runner(Protocol):
    """Runs the steps the Scheduler plans. Every method is called from the engine's serving thread."""

    # True: `fetch` moves the engine's (virtual) clock by the step's time itself (the simulator); False: time
    # passes on its own (a real clock) or is moved by the caller (cbjax.bench.online on a virtual clock).
    advances_clock: bool
    # Bytes copied by swaps since the runner was built, each way.
    swap_out_bytes_total: int
    swap_in_bytes_total: int

    @property
    def num_compiles(self) -> int:
        """Programs compiled for this runner so far (warmup included); it stays constant once warm, which is how
        the tests show that nothing recompiles after warmup. 0 for a runner that compiles nothing."""
        ...

    def warmup(self, mode: str = "full") -> float:
        """Build what the steps run, as `mode` (one of WARMUP_MODES) says; returns the seconds this call took.
        Raises ValueError for another mode."""
        ...

    def wait_until_warm(self) -> None:
        """Return once everything `warmup` started is built and has run once, so that a timed run that starts now
        compiles nothing and pays no first-run cost. Call it between steps."""
        ...

    def dispatch(self, out: SchedulerOutput) -> StepHandle:
        """Start step `out`: its KV swaps (complete when this returns), then its forward pass (if `out.seqs`), which
        may still be running when this returns. A sequence's pending token (sampled by the previously dispatched
        step, not yet fetched) is read from that step's result by the runner itself."""
        ...

    def fetch(self, handle: StepHandle) -> Sequence[int]:
        """Wait for a dispatched step and return one sampled token per scheduled sequence, in `out.seqs` order
        (any value where a sequence samples none); for a block of decode steps (out.num_steps > 1) a row of them
        per step; for a speculative step, each sequence's accepted drafts and its one sampled token."""
        ...

    def execute(self, out: SchedulerOutput) -> Sequence[int]:
        """`fetch(dispatch(out))`: one step, synchronously."""
        ...

    def swap(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> tuple[float, int, int]:
        """Copy KV pages: every (device page, host page) of `swap_out`, then every (host page, device page) of
        `swap_in`. Returns (real seconds, bytes out, bytes in) once done. ValueError, before copying anything, for a
        runner without a host pool or for pages out of range."""
        ...
