"""The skip-join multi-level feedback queue policy (FastServe), with its fast path's starvation check."""

import heapq
import itertools

from cbjax.config import validation as check
from cbjax.core.policy import Policy
from cbjax.core.request import Request, RequestStatus
from cbjax.core.sorted_ranking import merge_by_key


class MLFQPolicy(Policy):
    """Skip-join multi-level feedback queue (FastServe). Level i has a quantum of `quantum * 2**i` tokens of
    service (prefill and decode tokens); a request joins the highest level whose quantum covers its prompt (a long
    prompt skips the top levels), and drops a level each time it uses up its quantum. Lower levels are served (and
    preempted) last; FCFS within a level. A request not scheduled for `starvation_s` seconds returns to the top."""

    name = "mlfq"
    preempts_for_admission = True

    def __init__(
        self,
        num_levels: int = 4,
        quantum: int = 64,
        starvation_s: float | None = 5.0,
        victim: str = "rank",
        reserve_to_completion: bool | None = None,
        preempt_for_slot: bool = True,
    ):
        super().__init__(victim, reserve_to_completion)
        self.preempt_for_slot = check.boolean("mlfq preempt_for_slot", preempt_for_slot)
        self.num_levels = check.integer("mlfq num_levels", num_levels, 1, 32)
        self.quantum = check.integer("mlfq quantum", quantum, 1)
        self.starvation_s = check.optional_real("mlfq starvation_s (None: off)", starvation_s, 0.0, low_open=True)
        # The fast path's starvation check: (last_scheduled_time, n, request) of every arrival and scheduling,
        # oldest first, so a step looks only at the requests that may have starved since the last one.
        self._since: list[tuple[float, int, Request]] = []
        self._pushes = itertools.count()
        self._starved_running: list[Request] = []  # starved while running: reset if they wait, unscheduled

    def quantum_of(self, level: int) -> int:
        return self.quantum << level

    def on_arrival(self, req, now):
        level = 0
        while level < self.num_levels - 1 and req.num_prompt_tokens > self.quantum_of(level):
            level += 1
        req.policy_state = [level, 0]  # [level, service attained at this level]
        self._note_scheduled(req)

    def on_scheduled(self, req, num_tokens, now):
        state = req.policy_state
        state[1] += num_tokens
        if state[1] > self.quantum_of(state[0]) and state[0] < self.num_levels - 1:
            state[0] += 1
            state[1] = 0
        self._note_scheduled(req)

    def _note_scheduled(self, req: Request) -> None:
        if self.starvation_s is not None:
            heapq.heappush(self._since, (req.last_scheduled_time, next(self._pushes), req))

    def _starved(self, req: Request, now: float) -> bool:
        return now - req.last_scheduled_time > self.starvation_s

    def rank(self, running, waiting, now):
        if self.starvation_s is not None:
            for r in waiting:
                if self._starved(r, now):
                    r.policy_state[:] = [0, 0]
        return sorted([*running, *waiting], key=lambda r: (r.policy_state[0], r.arrival_order))

    def waiting_key(self, req):
        return (req.policy_state[0], req.arrival_order)

    def stale_waiting_keys(self, now):
        """`rank`'s starvation reset, for the fast path: the waiting requests unscheduled for starvation_s return
        to the top. Only those scheduled (or arrived) longest ago are looked at; returns the ones whose level
        changed."""
        if self.starvation_s is None:
            return []
        candidates, self._starved_running = self._starved_running, []
        since = self._since
        while since and now - since[0][0] > self.starvation_s:
            candidates.append(heapq.heappop(since)[2])  # stale when scheduled since: _starved() says so below
        moved, seen = [], set()
        for req in candidates:
            if id(req) in seen or req.status is RequestStatus.FINISHED or not self._starved(req, now):
                continue
            seen.add(id(req))
            if req.status is RequestStatus.RUNNING:
                self._starved_running.append(req)  # not waiting now; reset if it waits before it is scheduled
                continue
            if req.policy_state[0] != 0:
                moved.append(req)
            req.policy_state[:] = [0, 0]
        return moved

    def rank_sorted(self, running, waiting, now):
        return merge_by_key(running, waiting, self.waiting_key)
