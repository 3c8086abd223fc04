"""The scheduler alone, driven by a fake runner that 'samples' a fixed token (pure Python, no model)."""

import random

import pytest

from cbjax.core import Request, SamplingParams, Scheduler, VirtualClock
from cbjax.core.request import RequestStatus
from tests.core.scheduler_setup import FlatConfig, make_scheduler


def make(n_prompt, max_tokens, rid, order=0):
    return Request(
        rid,
        list(range(3, 3 + n_prompt)),
        SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        0.0,
        seed=0,
        arrival_order=order,
    )


def run_step(s: Scheduler, token=7):
    out = s.schedule()
    s.update(out, [token] * len(out.seqs), eos_token_id=None, now=0.0)
    s.pool.check_consistent()
    return out


def test_chunked_prefill_splits_long_prompt_over_steps():
    s = make_scheduler(
        FlatConfig(max_num_seqs=4, max_num_batched_tokens=32, page_size=8, num_pages=64, max_model_len=256),
        VirtualClock(),
    )
    r = make(70, 2, "a")
    s.add(r)
    chunks = []
    while s.has_unfinished():
        out = run_step(s)
        chunks.append([(q.num_new_tokens, q.samples_token) for q in out.seqs])
    assert chunks == [[(32, False)], [(32, False)], [(6, True)], [(1, True)]]
    assert r.output_token_ids == [7, 7] and r.finish_reason.value == "length"
    assert s.pool.num_free == 64


def test_finished_sequence_frees_its_slot_for_the_next_step():
    s = make_scheduler(
        FlatConfig(max_num_seqs=2, max_num_batched_tokens=64, page_size=8, num_pages=64, max_model_len=256),
        VirtualClock(),
    )
    a, b, c = make(4, 1, "a", 0), make(4, 5, "b", 1), make(4, 3, "c", 2)
    for r in (a, b, c):
        s.add(r)
    out = run_step(s)
    assert [q.request.request_id for q in out.seqs] == ["a", "b"]  # two slots
    assert a.is_finished  # one token, done at its first step
    out = run_step(s)
    # a's slot goes to c in the very next step, next to b's decode
    assert [(q.request.request_id, q.num_new_tokens) for q in out.seqs] == [("b", 1), ("c", 4)]


def test_static_batch_admits_nothing_until_all_finished():
    s = make_scheduler(
        FlatConfig(
            max_num_seqs=2, max_num_batched_tokens=64, page_size=8, num_pages=64, max_model_len=256, policy="static"
        ),
        VirtualClock(),
    )
    a, b, c = make(4, 1, "a", 0), make(4, 4, "b", 1), make(4, 1, "c", 2)
    for r in (a, b, c):
        s.add(r)
    ids = []
    while s.has_unfinished():
        ids.append([q.request.request_id for q in run_step(s).seqs])
    assert ids == [["a", "b"], ["b"], ["b"], ["b"], ["c"]]


def test_static_batch_spreads_prefill_of_whole_batch_over_steps():
    s = make_scheduler(
        FlatConfig(
            max_num_seqs=4, max_num_batched_tokens=16, page_size=8, num_pages=64, max_model_len=256, policy="static"
        ),
        VirtualClock(),
    )
    reqs = [make(10, 2, str(i), i) for i in range(4)]
    for r in reqs:
        s.add(r)
    run_step(s)
    assert all(r.status is RequestStatus.RUNNING for r in reqs)  # the batch is all four, not what fit in step 1


def test_preemption_picks_last_admitted_and_requeues_it_first():
    # 6 pages of 4 tokens; two sequences of 8-token prompts growing to 14 tokens cannot both fit.
    s = make_scheduler(
        FlatConfig(max_num_seqs=4, max_num_batched_tokens=64, page_size=4, num_pages=6, max_model_len=64),
        VirtualClock(),
    )
    a, b = make(8, 6, "a", 0), make(8, 6, "b", 1)
    s.add(a)
    s.add(b)
    preempted = []
    while s.has_unfinished():
        out = run_step(s)
        preempted += [r.request_id for r in out.preempted]
    assert preempted and preempted[0] == "b"
    assert a.output_token_ids == [7] * 6 and b.output_token_ids == [7] * 6
    assert b.num_preemptions >= 1 and s.pool.num_free == 6


def test_random_workloads_always_finish_without_leaks():
    rng = random.Random(0)
    for trial in range(20):
        cfg = FlatConfig(
            max_num_seqs=rng.randint(1, 6),
            max_num_batched_tokens=rng.choice([8, 16, 64]),
            page_size=rng.choice([2, 4, 8]),
            num_pages=rng.randint(12, 40),
            max_model_len=48,
            policy=rng.choice(["fcfs", "static"]),
        )
        s = make_scheduler(cfg, VirtualClock())
        reqs = []
        for i in range(rng.randint(1, 12)):
            n, m = rng.randint(1, 30), rng.randint(1, 18)
            if s.can_ever_fit(n + m):
                reqs.append(make(n, m, str(i), i))
                s.add(reqs[-1])
        for _ in range(5000):
            if not s.has_unfinished():
                break
            run_step(s)
        assert not s.has_unfinished(), f"trial {trial} did not finish"
        assert all(len(r.output_token_ids) == r.params.max_tokens for r in reqs)
        assert s.pool.num_free == cfg.num_pages


def test_can_ever_fit_refuses_requests_bigger_than_the_pool_or_model_len():
    s = make_scheduler(FlatConfig(page_size=4, num_pages=3, max_model_len=100), VirtualClock())
    assert s.can_ever_fit(12) and not s.can_ever_fit(13)
    s = make_scheduler(FlatConfig(page_size=4, num_pages=100, max_model_len=10), VirtualClock())
    assert not s.can_ever_fit(11)


def test_unknown_policy_is_a_clear_error():
    with pytest.raises(ValueError, match="policy must be one of"):
        make_scheduler(FlatConfig(policy="nope"), VirtualClock())


def test_static_batch_timeout_waits_for_full_batch_or_timeout():
    clock = VirtualClock()
    s = make_scheduler(
        FlatConfig(
            max_num_seqs=3,
            max_num_batched_tokens=64,
            page_size=8,
            num_pages=64,
            max_model_len=256,
            policy="static",
            static_batch_timeout_s=1.0,
        ),
        clock,
    )
    s.add(make(4, 1, "a", 0))
    assert s.schedule().is_empty  # one of three, not timed out
    clock.advance(0.5)
    s.add(make(4, 1, "b", 1))
    assert s.schedule().is_empty
    clock.advance(0.5)  # a has waited 1.0 s
    assert [q.request.request_id for q in run_step(s).seqs] == ["a", "b"]
    for i in range(3):
        s.add(make(4, 1, f"c{i}", 2 + i))
    assert [q.request.request_id for q in run_step(s).seqs] == ["c0", "c1", "c2"]  # full: no wait
