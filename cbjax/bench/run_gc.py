"""The cyclic garbage collector around one online run (cbjax.bench.online.run_online).

What exists before a run (the imported libraries, the workload, the engine) is not the run's garbage: it is frozen
(gc.freeze), so the collector's full passes walk only the objects the run makes; walking everything took ~10% of a
simulated run. A simulated run also pauses the collector until it ends: its passes over the run's own objects (the
requests, step records, token lists, which all outlive the run) were 2-8% of a zoo entry's time, and a simulated run
makes no cyclic garbage for it to find (gc.collect() after each entry of configs/sim_zoo.py found none). Whatever a
run does leave is collected once the collector is back on. What the run made (its records outlive it) then joins
the oldest generation with everything else: left young, the first collection after the run walked it all (every
token list), ~30 ms per zoo entry.
"""

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def run_objects_only(pause: bool = False) -> Iterator[bool]:
    """Freeze what exists now for the run's length (and with `pause` keep the collector off meanwhile). Yields
    whether it froze: not when the caller froze objects itself (unfreezing would undo that)."""
    enabled = gc.isenabled()
    if pause:
        gc.disable()
    try:
        if gc.get_freeze_count():
            yield False
            return
        gc.freeze()
        try:
            yield True
        finally:
            if pause:  # what the run made joins the oldest generation too, not through a young collection
                gc.freeze()
            gc.unfreeze()
    finally:
        if enabled:
            gc.enable()
