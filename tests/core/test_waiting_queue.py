"""WaitingQueue: a snapshot lent to the scheduler's walk never changes under it, while the queue itself (length,
membership, iteration) reflects every change at once; removals held back during the walk land at `release`."""

from hypothesis import given, settings
from hypothesis import strategies as st

from cbjax.core import Request, SamplingParams
from cbjax.core.waiting_queue import WaitingQueue


def _requests(n):
    return [Request(f"r{i}", [1, 2, 3], SamplingParams(), float(i), 0, i, priority=i % 3) for i in range(n)]


def _priority_key(r):
    return (r.priority, r.arrival_order)


@settings(max_examples=200, deadline=None)
@given(st.booleans(), st.lists(st.tuples(st.sampled_from("aaarrxslv"), st.integers(0, 11)), max_size=80))
def test_matches_a_plain_list_and_snapshots_stay_put(sorted_queue, ops):
    """Random appends, removals, rekeys, snapshots, releases and reads ("v") against a reference: a list kept in
    (key, joining order) (or joining order alone). Reading the whole queue settles what a snapshot held back, so
    it is an operation of its own; length and membership are checked after every one."""
    reqs = _requests(12)
    key = _priority_key if sorted_queue else None
    q = WaitingQueue(key)
    ref: list[tuple] = []  # (key, seq, request) in queue order
    seq = 0
    lent = None  # (requests list, keys list, copies of both at snapshot time)
    for op, i in ops:
        r = reqs[i]
        inside = any(e[2] is r for e in ref)
        if op == "a" and not inside:
            seq += 1
            q.append(r)
            ref.append(((key(r) if key else ()), seq, r))
        elif op == "r" and inside:
            q.remove(r)
            ref = [e for e in ref if e[2] is not r]
        elif op == "x" and inside and key:  # the policy changed its key while it waited
            r.priority = (r.priority + 1) % 3
            q.rekey(r)
            ref = [(key(e[2]), e[1], e[2]) if e[2] is r else e for e in ref]
        elif op == "s":
            got = q.snapshot()
            lent = (got[0], got[1], list(got[0]), list(got[1]))
        elif op == "l":
            q.release()
            lent = None
        if key:
            ref.sort(key=lambda e: (e[0], e[1]))
        want = [e[2] for e in ref]
        if op == "v":
            assert list(q) == want
        assert len(q) == len(want) and bool(q) == bool(want)
        assert all((r in q) == (r in want) for r in reqs)
        if lent is not None:  # what the walk reads has not moved
            assert lent[0] == lent[2] and lent[1] == lent[3]
    q.release()
    assert q.requests == [e[2] for e in ref]


def test_removals_during_a_walk_copy_nothing():
    """Admissions while the walk reads the snapshot leave its lists alone and are applied to them in place once it
    is released (no copy of the queue per step)."""
    reqs = _requests(5)
    q = WaitingQueue(_priority_key)
    for r in reqs:
        q.append(r)
    lists, keys = q.snapshot()
    before = list(lists)
    q.remove(reqs[0])
    q.remove(reqs[3])
    assert lists == before and len(q) == 3 and reqs[0] not in q
    q.release()
    assert q.requests is lists and len(keys) == 3
    assert lists == [r for r in before if r not in (reqs[0], reqs[3])]
