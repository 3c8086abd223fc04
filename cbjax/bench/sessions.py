"""Multi-turn sessions in the online loop, closed-loop: a session's next turn is released only once its previous
turn has finished, with the tokens the engine actually generated in its prompt.

A conversation's turn k+1 prompt is turn k's prompt + turn k's answer + a new user message (the `sessions` workload
kind, cbjax.bench.generators.session_workload; the fields on cbjax.bench.requests.WorkloadRequest). For a prefix
cache to hit, the answer inside the next prompt must be exactly what the engine generated, so the next turn cannot
be written in advance: as vLLM's multi-turn benchmark does, the client waits for the answer, then for the user's
think time, then sends the next message. `Arrivals` is that client: the online loop (cbjax/bench/online.py) takes
every arrival from it, and tells it when a request has finished.

A session whose turn is aborted or refused ends there: its later turns are never sent (`num_dropped`).
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
from collections import deque
from collections.abc import Sequence

from cbjax.bench.requests import WorkloadRequest
from cbjax.core.outputs import RequestOutput


def session_turns(workload: Sequence[WorkloadRequest]) -> dict[str, list[WorkloadRequest]]:
    """Each session's turns in turn order; ValueError unless every session has exactly the turns 0, 1, ..., n-1."""
    sessions: dict[str, list[WorkloadRequest]] = {}
    for r in workload:
        if r.session_id is not None:
            sessions.setdefault(r.session_id, []).append(r)
    for sid, turns in sessions.items():
        turns.sort(key=lambda r: r.turn)
        numbers = [r.turn for r in turns]
        if numbers != list(range(len(turns))):
            raise ValueError(f"session {sid!r} has turns {numbers}: each session needs exactly turns 0, 1, ..., n-1")
    return sessions


class Arrivals:
    """The requests yet to arrive, in arrival order: the workload's own (by `arrival_time`) and the sessions' later
    turns, each released at its previous turn's finish time + its think time, its prompt built from that turn's
    prompt and output. Times are seconds from the start of the run."""

    def __init__(self, workload: Sequence[WorkloadRequest]):
        sessions = session_turns(workload)
        self._timed = deque(sorted((r for r in workload if r.turn == 0), key=lambda r: r.arrival_time))
        self._later = {sid: deque(turns[1:]) for sid, turns in sessions.items() if len(turns) > 1}
        self._num_later = sum(len(t) for t in self._later.values())
        self._released: list[tuple[float, int, WorkloadRequest]] = []  # a heap, ties in release order
        self._order = itertools.count()
        self.num_dropped = 0  # later turns never sent: their session ended with an aborted or refused turn

    def __len__(self) -> int:
        """Requests that can still arrive: the timed ones, the released turns and the turns waiting on their
        session (each of those has a turn in the engine or above)."""
        return len(self._timed) + self._num_later

    def next_time(self) -> float | None:
        """When the next request arrives, if one is known (a turn waiting on a running one is not)."""
        times = [self._timed[0].arrival_time] if self._timed else []
        if self._released:
            times.append(self._released[0][0])
        return min(times, default=None)

    def pop_due(self, now: float) -> WorkloadRequest | None:
        """The earliest request whose arrival time is <= now (removed), or None."""
        timed = self._timed[0].arrival_time if self._timed else None
        released = self._released[0][0] if self._released else None
        if released is not None and released <= now and (timed is None or released < timed):
            self._num_later -= 1
            return heapq.heappop(self._released)[2]
        if timed is not None and timed <= now:
            return self._timed.popleft()
        return None

    def finished(self, req: WorkloadRequest, output: RequestOutput | None, t0: float) -> None:
        """`req` (as submitted) finished with `output` (None: the engine refused it); `t0` is the run's start on
        the engine's clock. Completed, it releases the session's next turn at its finish time + the next turn's
        think time, that turn's prompt being `req`'s prompt + the generated tokens + its message. Aborted or
        refused, it ends the session."""
        later = self._later.get(req.session_id) if req.session_id is not None else None
        if not later or later[0].turn != req.turn + 1:
            return
        completion = None if output is None else output.outputs[0]
        if completion is None or completion.finish_reason not in ("stop", "length"):
            self.num_dropped += len(later)
            self._num_later -= len(later)
            del self._later[req.session_id]
            return
        nxt = later.popleft()
        m = output.metrics
        finished_at = (m.finished_time if m.finished_time is not None else m.token_times[-1]) - t0
        arrival = finished_at + nxt.think_time_s
        prompt = (*req.prompt_token_ids, *completion.token_ids, *nxt.prompt_token_ids)
        # A deadline keeps its slack after the arrival, as when a trace's arrival times move.
        deadline = None if nxt.deadline is None else nxt.deadline - nxt.arrival_time + arrival
        released = dataclasses.replace(nxt, prompt_token_ids=prompt, arrival_time=arrival, deadline=deadline)
        heapq.heappush(self._released, (arrival, next(self._order), released))
