"""The machine's measurement lock: an exclusive flock on a file that every timed run on this machine takes.

The cores are shared by several people's work at once; a measurement holds the lock for one timed unit (one
process, or one round that pairs the sides it compares) and lets it go between units, so that others get turns
and no unit shares its minute with another measurement.
"""

from __future__ import annotations

import contextlib
import fcntl


@contextlib.contextmanager
def held(path: str | None):
    """Hold an exclusive flock on `path` for the block (no lock when `path` is None)."""
    if path is None:
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
