"""Scheduling policies: the small decisions a Scheduler delegates.

A policy answers three questions each step: may waiting requests be admitted now, which waiting request comes
next, and which running request is preempted when pages run out. The Scheduler does the bookkeeping (budgets,
pages, state changes), so a new policy is one small class.
"""
from collections.abc import Sequence

from cbjax.core.request import Request


class Policy:
    """Continuous FCFS: running sequences first, then waiting ones in arrival order; victim = last admitted."""

    name = "fcfs"
    # When True, admission moves a whole batch (up to max_num_seqs) into the running set at once, and prefill of
    # its members is spread over as many steps as the token budget needs.
    admits_whole_batch = False

    def may_admit(self, running: Sequence[Request], waiting: Sequence[Request], now: float) -> bool:
        return True

    def next_waiting_index(self, waiting: Sequence[Request]) -> int:
        return 0

    def choose_victim(self, running: Sequence[Request]) -> Request:
        return running[-1]


class StaticPolicy(Policy):
    """Static batching: admit up to max_num_seqs requests together and admit nothing more until every one of them
    has finished. The baseline continuous batching is measured against, on the same runner.

    With `batch_timeout_s` > 0 a new batch also waits until it is full or its oldest request has waited that long
    (the server-side static batcher of online serving); 0 starts a batch with whatever is waiting.
    """

    name = "static"
    admits_whole_batch = True

    def __init__(self, max_num_seqs: int = 1, batch_timeout_s: float = 0.0):
        self.max_num_seqs = max_num_seqs
        self.batch_timeout_s = batch_timeout_s

    def may_admit(self, running: Sequence[Request], waiting: Sequence[Request], now: float) -> bool:
        if running or not waiting:
            return False
        if self.batch_timeout_s <= 0 or len(waiting) >= self.max_num_seqs:
            return True
        return now - min(r.metrics.arrival_time for r in waiting) >= self.batch_timeout_s


POLICIES: dict[str, type[Policy]] = {"fcfs": Policy, "static": StaticPolicy}


def make_policy(name: str, **options) -> Policy:
    """Build a policy by name; `options` are passed to policies whose constructor takes them."""
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; known: {sorted(POLICIES)}")
    cls = POLICIES[name]
    import inspect

    accepted = inspect.signature(cls.__init__).parameters
    return cls(**{k: v for k, v in options.items() if k in accepted})
