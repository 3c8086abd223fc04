"""The fast path (a policy's waiting_key + rank_sorted over the scheduler's sorted queue, cbjax.core.policy) makes
exactly the decisions of the general path (`rank` every step over the whole queue), which custom policies take.

Each built-in policy with a fast path is run twice on the same request stream, in lockstep: as it is, and as a
"general" twin with no waiting_key whose `rank` is the policy's ranking as it was before the fast path existed
(copied below, sorting the whole queue every step). Every step's batch must be equal (hypothesis).
"""

import dataclasses
import heapq

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cbjax.core import Request, SamplingParams, VirtualClock
from cbjax.core.policy import Ranking, SortedWaiting, by_admission, by_arrival, fcfs_order
from cbjax.core.policy_zoo import FCFSPolicy, make_policy
from tests.core.fake_runner import FakeRunner
from tests.core.scheduler_setup import FlatConfig, make_scheduler
from tests.core.test_policy_invariants import EOS, VOCAB, cases


# ---- the rankings before the fast path, verbatim: the reference ---------------------------------------------------
def _sarathi(p, running, waiting, now):
    running = by_admission(running)
    decodes = [r for r in running if r.num_uncomputed_tokens <= 1]
    prefills = [r for r in running if r.num_uncomputed_tokens > 1]
    return decodes + prefills + by_arrival(waiting)


def _three_level(p, running, waiting, now):
    running = by_admission(running)
    return by_arrival(waiting) + [r for r in running if not p.demoted(r)] + [r for r in running if p.demoted(r)]


def _mlfq(p, running, waiting, now):
    if p.starvation_s is not None:
        for r in waiting:
            if now - r.last_scheduled_time > p.starvation_s:
                r.policy_state[:] = [0, 0]
    return sorted([*running, *waiting], key=lambda r: (r.policy_state[0], r.arrival_order))


def _fair_share(p, running, waiting, now):
    queues = {}
    for r in by_arrival(waiting):
        queues.setdefault(r.tenant, []).append(r)
    heap = [(p.counters.get(t, 0.0), q[0].arrival_order, t) for t, q in queues.items()]
    heapq.heapify(heap)
    order, pos = [], dict.fromkeys(queues, 0)
    while heap:
        c, _, t = heapq.heappop(heap)
        q = queues[t]
        r = q[pos[t]]
        order.append(r)
        pos[t] += 1
        if pos[t] < len(q):
            c += r.num_prompt_tokens * p.input_weight / p.weight(t)
            heapq.heappush(heap, (c, q[pos[t]].arrival_order, t))
    return by_admission(running) + order


def _lpm(p, running, waiting, now):
    view = p.view
    if view is None or not view.prefix_caching:
        return fcfs_order(running, waiting)

    def score(r):
        waited = now - r.metrics.arrival_time
        return view.cached_prefix_tokens(r) + p.aging_tokens_per_s * waited

    return by_admission(running) + sorted(waiting, key=lambda r: (-score(r), r.arrival_order))


OLD_RANK = {
    "fcfs": lambda p, running, waiting, now: fcfs_order(running, waiting),
    "static": lambda p, running, waiting, now: fcfs_order(running, waiting),
    "prefill_first": lambda p, running, waiting, now: by_arrival(waiting) + by_admission(running),
    "sarathi": _sarathi,
    "three_level": _three_level,
    "sjf": lambda p, running, waiting, now: (
        by_admission(running) + sorted(waiting, key=lambda r: (r.num_prompt_tokens, r.arrival_order))
    ),
    "srpt_oracle": lambda p, running, waiting, now: sorted(
        [*running, *waiting], key=lambda r: (p.remaining(r), r.arrival_order)
    ),
    "mlfq": _mlfq,
    "priority": lambda p, running, waiting, now: sorted(
        [*running, *waiting], key=lambda r: (p.effective_priority(r, now), r.arrival_order)
    ),
    "lpm": _lpm,
    "fair_share": _fair_share,
    "edf": lambda p, running, waiting, now: sorted(
        [*running, *waiting], key=lambda r: (p.deadline(r), r.arrival_order)
    ),
}


def general_twin(policy):
    """The same policy object's state and options, on the general path with the old ranking."""
    cls = type(policy)
    old = OLD_RANK[cls.name]
    twin_cls = type(f"General{cls.__name__}", (cls,), {"waiting_key": None, "rank": old})
    policy.__class__ = twin_cls
    return policy


def policies_of(config):
    opts = dict(batch_timeout_s=config.static_batch_timeout_s)
    fast = make_policy(config.policy, config.policy_options, **opts)
    general = general_twin(make_policy(config.policy, config.policy_options, **opts))
    assert fast.waiting_key is not None and general.waiting_key is None
    return fast, general


def batch(out) -> tuple:
    return (
        [(q.request.request_id, q.num_computed_tokens, q.num_new_tokens, q.samples_token) for q in out.seqs],
        [r.request_id for r in out.preempted],
        out.swap_out,
        out.swap_in,
        out.num_batched_tokens,
    )


def run_lockstep(case, clock, scheds, after_update=None, after_step=None) -> tuple[int, list[dict]]:
    """Drive two schedulers built on `clock` in lockstep through `case` (its arrivals, aborts, synchronous or
    asynchronous updates), each with its own fake runner, requiring the same batch and tokens at every step. Calls
    `after_update(scheduler, its step's output)` after each update and `after_step(step, outputs, requests)` after
    both (requests: per scheduler, request id -> (Request, abort step)). Returns the steps and the requests."""
    runners = [FakeRunner(s, VOCAB) for s in scheds]
    reqs: list[dict] = [{}, {}]
    pending = sorted(enumerate(case.requests), key=lambda x: x[1][0])
    step, in_flight = 0, [None, None]
    while pending or any(s.has_unfinished() for s in scheds) or any(in_flight):
        while pending and pending[0][1][0] <= step:
            i, (_, prompt, max_tokens, prio, tenant, slack, abort_at) = pending.pop(0)
            for k, s in enumerate(scheds):
                r = Request(
                    f"r{i}", prompt, SamplingParams(max_tokens=max_tokens), clock.now(), seed=0, arrival_order=i,
                    priority=prio, tenant=tenant, deadline=None if slack is None else clock.now() + slack,
                )  # fmt: skip
                s.add(r)
                reqs[k][r.request_id] = (r, abort_at)
        for k, s in enumerate(scheds):
            for r, abort_at in reqs[k].values():
                if abort_at == step and not r.is_finished:
                    s.abort(r)
        outs = [s.schedule() for s in scheds]
        assert batch(outs[0]) == batch(outs[1]), f"step {step}"
        tokens = [runner.execute(out) for runner, out in zip(runners, outs)]
        assert list(tokens[0]) == list(tokens[1])
        clock.advance(0.001)
        for k, s in enumerate(scheds):
            if case.asynchronous:
                if in_flight[k] is not None:
                    s.update(*in_flight[k], EOS, clock.now())
                in_flight[k] = (outs[k], tokens[k]) if outs[k].seqs else None
            else:
                s.update(outs[k], tokens[k], EOS, clock.now())
            if after_update is not None:
                after_update(s, outs[k])
        if after_step is not None:
            after_step(step, outs, reqs)
        step += 1
        if step == 2000:  # mlfq with a starvation limit of a step or two can preempt back and forth for ever
            break  # (both paths alike): 2000 equal steps are the check
    return step, reqs


def run_both(case, make_policies=policies_of, after_update=None) -> tuple[int, list[Request]]:
    """Drive a fast-path and a general-path scheduler in lockstep (`run_lockstep`, which also requires the same
    waiting order at every step); returns the number of steps and the fast path's requests. `make_policies`
    (config -> (fast, general)) builds the pair; `after_update(scheduler, its step's output)` checks each scheduler
    after every update (tests/core/test_length_aware.py)."""
    config = dataclasses.replace(case.config, policy_options=case.policy_options)
    clock = VirtualClock()
    fast_policy, general_policy = make_policies(config)
    scheds = [make_scheduler(config, clock, fast_policy), make_scheduler(config, clock, general_policy)]

    def same_waiting_order(step, outs, reqs):
        assert [r.request_id for r in scheds[0].waiting] == [
            r.request_id for r in SortedWaiting.of(scheds[1].waiting, fast_policy.waiting_key).requests
        ], f"step {step}"

    step, reqs = run_lockstep(case, clock, scheds, after_update, same_waiting_order)
    return step, [r for r, _ in reqs[0].values()]


@st.composite
def fast_path_cases(draw):
    case = draw(cases())
    policy = draw(st.sampled_from(sorted(OLD_RANK)))
    options = dict(case.policy_options)
    if policy != case.config.policy:  # cases() drew options for another policy: keep only the common ones
        options = {"victim": options["victim"]}
        if policy != "static" and "reserve_to_completion" in case.policy_options:
            options["reserve_to_completion"] = case.policy_options["reserve_to_completion"]
    if policy == "mlfq":
        # Steps are 1 ms apart: short starvation limits make the reset (and its re-sorting of the queue) happen.
        options["starvation_s"] = draw(st.sampled_from([None, 0.0015, 0.004, 5.0]))
        options["quantum"] = draw(st.integers(1, 8))
    if policy == "priority":
        # Aging by a class per step or so: effective priorities of different classes meet (ties, rounding).
        options["aging_s"] = draw(st.sampled_from([None, 0.001, 0.003, 0.0007, 10.0]))
    if policy == "lpm":
        options["aging_tokens_per_s"] = draw(st.sampled_from([0.0, 300.0, 5000.0]))
    if policy == "fair_share":
        options["tenant_weights"] = draw(st.sampled_from([None, {"a": 2.0}, {"b": 0.5, "c": 3.0}]))
    config = dataclasses.replace(case.config, policy=policy)
    # Longer streams than cases(): queues a few deep, where the order matters.
    extra = draw(st.integers(0, 20))
    requests = list(case.requests)
    for j in range(extra):
        requests.append(requests[j % len(requests)][:0] + (j % 15,) + requests[j % len(requests)][1:])
    return dataclasses.replace(case, config=config, policy_options=options, requests=requests)


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fast_path_cases())
def test_the_fast_path_schedules_exactly_as_the_general_path(case):
    run_both(case)


def test_a_custom_policy_keeps_the_general_path():
    """A policy that only implements rank is ranked every step, its waiting queue in joining order."""
    from tests.core.test_custom_policy import LongestPromptFirst

    s = make_scheduler(_tiny_config(), VirtualClock(), LongestPromptFirst())
    assert not s.waiting.sorted
    for i, n in enumerate([3, 9, 5]):
        s.add(Request(f"r{n}", [5] * n, SamplingParams(max_tokens=1), 0.0, 0, i))
    assert [r.request_id for r in s.waiting] == ["r3", "r9", "r5"]
    assert [q.request.request_id for q in s.schedule().seqs] == ["r9"]


def _tiny_config():

    return FlatConfig(max_num_seqs=1, max_num_batched_tokens=64, page_size=4, num_pages=32, max_model_len=64)


class CountingFCFS(FCFSPolicy):
    """fcfs that counts the ranking entries a step reads."""

    read = 0

    def rank_sorted(self, running, waiting, now):
        ranking = super().rank_sorted(running, waiting, now)

        def counted():
            for r in ranking.order:
                self.read += 1
                yield r

        return Ranking(counted(), ranking.running)


def test_a_step_does_not_walk_a_long_queue():
    """With every slot taken, a step looks at the running requests and the head of the queue, not at all 5000
    waiting ones (the cost that made 10k-request simulations take minutes)."""
    config = _tiny_config()
    policy = CountingFCFS()
    s = make_scheduler(dataclasses.replace(config, max_num_seqs=2, num_pages=64), VirtualClock(), policy)
    for i in range(5000):
        s.add(Request(f"r{i}", [5] * 8, SamplingParams(max_tokens=50), 0.0, 0, i))
    for _ in range(5):
        policy.read = 0
        out = s.schedule()
        s.update(out, [7] * len(out.seqs), None, 0.0)
        assert len(out.seqs) == 2 and policy.read <= 4  # two running (or admitted), the head that waits, one more


def test_priority_ties_go_as_in_rank():
    """Cases a run hardly ever makes: effective priorities equal by rounding (arrival times one ulp apart, later
    arrival order first), and equal (priority, arrival order) between a running and a waiting request."""
    import math

    from cbjax.core.request import RequestStatus

    policy = make_policy("priority", {"aging_s": 1.0})
    a = 1.0
    b = math.nextafter(a, 2.0)
    specs = [  # (id, priority, arrival time, arrival order, running)
        ("w1", 1, a, 7, False), ("w2", 1, b, 3, False), ("w3", 1, b, 4, False), ("w4", 0, 5.0, 9, False),
        ("r1", 1, a, 7, True), ("r2", 0, 5.0, 9, True), ("w5", 2, 0.0, 1, False),
    ]  # fmt: skip
    reqs = []
    for rid, prio, t, order, running in specs:
        r = Request(rid, [1, 2], SamplingParams(max_tokens=1), t, 0, order, priority=prio)
        r.status = RequestStatus.RUNNING if running else RequestStatus.WAITING
        reqs.append(r)
    running = [r for r in reqs if r.status is RequestStatus.RUNNING]
    waiting = [r for r in reqs if r.status is not RequestStatus.RUNNING]
    now = 1e6  # now - a and now - b round to the same number
    assert policy.effective_priority(reqs[0], now) == policy.effective_priority(reqs[1], now)
    want = [r.request_id for r in OLD_RANK["priority"](policy, running, waiting, now)]
    got = policy.rank_sorted(running, SortedWaiting.of(waiting, policy.waiting_key), now)
    assert [r.request_id for r in got.order] == want
    assert want.index("w2") < want.index("w1") and want.index("r1") < want.index("w1")
