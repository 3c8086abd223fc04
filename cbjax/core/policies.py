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

    def may_admit(self, running: Sequence[Request]) -> bool:
        return True

    def next_waiting_index(self, waiting: Sequence[Request]) -> int:
        return 0

    def choose_victim(self, running: Sequence[Request]) -> Request:
        return running[-1]


class StaticPolicy(Policy):
    """Static batching: admit up to max_num_seqs requests together and admit nothing more until every one of them
    has finished. The baseline continuous batching is measured against, on the same runner."""

    name = "static"
    admits_whole_batch = True

    def may_admit(self, running: Sequence[Request]) -> bool:
        return not running


POLICIES: dict[str, type[Policy]] = {"fcfs": Policy, "static": StaticPolicy}


def make_policy(name: str) -> Policy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; known: {sorted(POLICIES)}") from None
