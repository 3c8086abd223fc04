"""Ctrl-C during an experiment: a request to stop at a safe point, not an exception raised wherever it lands."""

import signal
import sys
import threading


class CtrlC:
    """Ctrl-C as a request, not an exception: the first one sets `pressed` (and says what happens next); the code
    acts on it at a safe point (between engine steps, after an engine is built). A KeyboardInterrupt raised inside
    jax's compile or dispatch once left the process to crash at exit. A second Ctrl-C stops at once.

    Off the main thread (where signals cannot be handled) it does nothing."""

    def __init__(self, what_next: str):
        self.what_next = what_next
        self.pressed = False
        self._previous = None

    def _handler(self, signum, frame):
        self.pressed = True
        print(f"\nCtrl-C: {self.what_next} (Ctrl-C again to stop at once)", file=sys.stderr)
        signal.signal(signal.SIGINT, self._previous)

    def __enter__(self) -> "CtrlC":
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handler)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
