"""Invariants of every policy, both preemption modes and the prefix cache, on small page pools (hypothesis).

Driven by tests/core/fake_runner.py, whose tokens depend on the KV content read back through the page tables, so
"the tokens equal the reference" checks pages, swaps and cache hits, not only the bookkeeping. Per step: page pool
and host pool consistent, each page's refcount equals the number of sequences holding it, slot and token limits
kept. At the end: every request finished with exactly the reference tokens (or was aborted), nothing leaked.
"""

import dataclasses
import inspect

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cbjax.core import Request, SamplingParams, Scheduler, SchedulerConfig, VirtualClock
from cbjax.core.policy import VICTIMS
from cbjax.core.policy_zoo import POLICIES
from cbjax.core.request import RequestStatus
from cbjax.core.scheduler import pages_for
from tests.core.fake_runner import FakeRunner, reference
from tests.core.scheduler_setup import FlatConfig, make_scheduler

VOCAB = 40
EOS = 0


@dataclasses.dataclass
class Case:
    config: SchedulerConfig
    policy_options: dict
    requests: list  # (arrival step, prompt, max_tokens, priority, tenant, deadline, abort step or None)
    # Asynchronous scheduling: step n+1 is scheduled (and run) before the results of step n are received.
    asynchronous: bool = False


@st.composite
def length_options(draw, policy: str) -> dict:
    """A length-aware policy's predictor and, for hrrn and slo_aware, costs and targets that make the order move
    within a few steps (steps are 1 ms apart)."""
    # sjf keeps its default (no predictor, prompt length only) here: test_fast_ranking.py checks it against that
    # order; tests/core/test_length_aware.py runs it with each predictor.
    kinds = [None] if policy == "sjf" else ["oracle", "noisy", "learned"]
    options = {"length_predictor": draw(st.sampled_from(kinds))}
    if options["length_predictor"] == "noisy":
        options.update(sigma=draw(st.sampled_from([0.0, 0.5, 2.0])), predictor_seed=draw(st.integers(0, 3)))
    if options["length_predictor"] == "learned":
        options["prior_tokens"] = draw(st.integers(1, 16))
    if policy in ("hrrn", "slo_aware"):
        options["decode_s_per_token"] = draw(st.sampled_from([0.0, 0.001, 0.01]))
    if policy == "slo_aware":
        options["ttft_slo_s"] = draw(st.sampled_from([0.002, 0.01, 1.0]))
        options["e2e_slo_s"] = draw(st.sampled_from([None, 0.005, 0.05]))
        options["late_last"] = draw(st.booleans())
    return options


@st.composite
def cases(draw):
    G = draw(st.sampled_from([2, 4, 8]))
    max_model_len = draw(st.integers(12, 40))
    num_pages = draw(st.integers(pages_for(max_model_len, G), pages_for(max_model_len, G) * 2))
    mode = draw(st.sampled_from(["recompute", "swap"]))
    policy = draw(st.sampled_from(sorted(POLICIES)))
    config = FlatConfig(
        max_num_seqs=draw(st.integers(1, 6)),
        max_num_batched_tokens=draw(st.sampled_from([4, 8, 16, 64])),
        page_size=G,
        num_pages=num_pages,
        max_model_len=max_model_len,
        policy=policy,
        enable_chunked_prefill=draw(st.booleans()),
        watermark_pages=draw(st.integers(0, min(2, num_pages - 1))),  # the engine keeps it below the pool
        preemption_mode=mode,
        num_host_pages=draw(st.integers(0, 3 * num_pages)) if mode == "swap" else 0,
        enable_prefix_caching=draw(st.booleans()),
        num_scheduler_steps=draw(st.sampled_from([1, 1, 2, 4])),  # blocks of decode steps (core/multi_step.py)
    )
    options = {"victim": draw(st.sampled_from(sorted(VICTIMS)))}
    if policy == "sarathi":
        options["chunk_size"] = draw(st.sampled_from([None, 3, 8]))
    if policy == "three_level":
        options["demote_after"] = draw(st.integers(0, 6))
    if policy == "mlfq":
        options["quantum"] = draw(st.integers(1, 8))
    if policy not in ("static",):
        options["reserve_to_completion"] = draw(st.booleans())
    if "preempt_for_slot" in inspect.signature(POLICIES[policy]).parameters:  # the policies whose arrivals preempt
        options["preempt_for_slot"] = draw(st.booleans())
    if "length_predictor" in inspect.signature(POLICIES[policy]).parameters:  # cbjax/core/length_aware.py
        options.update(draw(length_options(policy)))
    # Prompts built from a few shared prefixes, so prefix-cache hits (full and partial) happen.
    # Page-aligned prefixes, and prompts that are just a prefix, make whole-prompt hits (the last page must still
    # be computed, never shared).
    prefixes = [
        draw(st.lists(st.integers(1, VOCAB - 1), min_size=n, max_size=n))
        for n in draw(st.lists(st.sampled_from([G, 2 * G, 3]), min_size=1, max_size=2))
    ]
    requests = []
    for _i in range(draw(st.integers(1, 10))):
        prompt = draw(st.sampled_from(prefixes)) + draw(
            st.lists(st.integers(1, VOCAB - 1), min_size=0, max_size=max_model_len // 2)
        )
        prompt = prompt[: max_model_len - 1]
        max_tokens = draw(st.integers(1, max_model_len - len(prompt)))
        requests.append(
            (
                draw(st.integers(0, 12)),
                prompt,
                max_tokens,
                draw(st.integers(0, 2)),
                draw(st.sampled_from(["a", "b", "c"])),
                draw(st.none() | st.floats(0.0, 0.05)),
                draw(st.none() | st.integers(0, 30)) if draw(st.integers(0, 5)) == 0 else None,
            )
        )
    return Case(config, options, requests, asynchronous=draw(st.booleans()))


def check_step(s: Scheduler, out) -> None:
    cfg = s.config
    s.pool.check_consistent()
    if s.host_pool is not None:
        s.host_pool.check_consistent()
        # The samples of a group swapped out as a whole wait inside it (core/sequence_group.py) and share the host
        # pages of the pages they shared: a host page has a reference per holder, like a device page.
        parked = [f for r in s.waiting if r.group is not None and r.group.leader is r for f in r.group.followers]
        held = [p for r in (*s.waiting, *s.running, *parked) for p in r.host_pages]
        assert len(set(held)) == s.host_pool.num_used
        for p in set(held):
            assert s.host_pool.refcount(p) == held.count(p), f"host page {p}"
    assert len(s.running) <= cfg.max_num_seqs
    assert out.num_batched_tokens <= cfg.max_num_batched_tokens
    assert sum(q.num_new_tokens for q in out.seqs) == out.num_batched_tokens
    holders: dict[int, int] = {}
    for r in s.running:
        # Only a static batch admits swapped requests before their turn: their pages come back when it comes.
        assert r.status is RequestStatus.RUNNING and not (r.host_pages and r.pages)
        assert len(r.pages or r.host_pages) >= pages_for(r.num_computed_tokens, s.cache.page_size)
        for p in r.pages:
            holders[p] = holders.get(p, 0) + 1
    for r in s.waiting:
        assert not r.pages
    for p in range(s.cache.num_pages):
        assert s.pool.refcount(p) == holders.get(p, 0), f"page {p}"


def admit_and_abort(s: Scheduler, case: Case, clock, step: int, pending: list, reqs: dict, expected: dict) -> None:
    """Before step `step`: add the case's requests that have arrived (and their reference outputs), and abort
    those whose abort step it is."""
    while pending and pending[0][1][0] <= step:
        i, (_, prompt, max_tokens, prio, tenant, slack, abort_at) = pending.pop(0)
        r = Request(
            f"r{i}",
            prompt,
            SamplingParams(max_tokens=max_tokens),
            clock.now(),
            seed=0,
            arrival_order=i,
            priority=prio,
            tenant=tenant,
            deadline=None if slack is None else clock.now() + slack,
        )
        assert s.can_ever_fit(len(prompt) + max_tokens)
        s.add(r)
        reqs[r.request_id] = (r, abort_at)
        expected[r.request_id] = reference(prompt, max_tokens, VOCAB, EOS, case.config.max_model_len)
    for r, abort_at in reqs.values():
        if abort_at == step and not r.is_finished:
            s.abort(r)


def run_case(case: Case, on_schedule=None) -> None:
    """`on_schedule(scheduler, out)`: called with each step before it runs (tests/runner/test_step_packer.py)."""
    clock = VirtualClock()
    s = make_scheduler(dataclasses.replace(case.config, policy_options=case.policy_options), clock)
    runner = FakeRunner(s, VOCAB)
    reqs, expected = {}, {}
    pending = sorted(enumerate(case.requests), key=lambda x: x[1][0])
    step = 0
    in_flight = None  # (step, its sampled tokens) whose results the scheduler has not received yet
    while pending or s.has_unfinished() or in_flight:
        admit_and_abort(s, case, clock, step, pending, reqs, expected)
        out = s.schedule()
        if on_schedule is not None:
            on_schedule(s, out)
        tokens = runner.execute(out)
        clock.advance(0.001)
        if case.asynchronous:
            if in_flight is not None:
                s.update(*in_flight, EOS, clock.now())
            in_flight = (out, tokens) if out.seqs else None
        else:
            s.update(out, tokens, EOS, clock.now())
        check_step(s, out)
        step += 1
        assert step < 5000, "requests did not finish"
    for rid, (r, abort_at) in reqs.items():
        assert r.is_finished
        if r.finish_reason.value == "abort":
            assert abort_at is not None
            assert r.output_token_ids == expected[rid][: len(r.output_token_ids)]
        else:
            assert r.output_token_ids == expected[rid], rid
    assert s.pool.num_free == case.config.num_pages
    if s.host_pool is not None:
        assert s.host_pool.num_free == s.host_pool.num_pages
    assert runner.pages_swapped_out == s.num_swapped_out_pages
    assert runner.pages_swapped_in == s.num_swapped_in_pages


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_every_policy_finishes_everything_with_reference_tokens(case):
    run_case(case)


def test_swap_and_recompute_both_move_work_under_a_tight_pool():
    # Four sequences growing to 24 tokens in a pool of 12 pages of 4: preemption is certain.
    for mode, host in (("recompute", 0), ("swap", 64)):
        cfg = FlatConfig(
            max_num_seqs=4,
            max_num_batched_tokens=64,
            page_size=4,
            num_pages=12,
            max_model_len=32,
            preemption_mode=mode,
            num_host_pages=host,
        )
        reqs = [(0, list(range(1 + i, 9 + i)), 16, 0, "a", None, None) for i in range(4)]
        case = Case(cfg, {}, reqs)
        run_case(case)
        s = make_scheduler(cfg, VirtualClock())
        runner = FakeRunner(s, VOCAB)
        for i, (_, prompt, m, *_rest) in enumerate(reqs):
            s.add(Request(f"r{i}", prompt, SamplingParams(max_tokens=m, ignore_eos=True), 0.0, 0, i))
        while s.has_unfinished():
            out = s.schedule()
            s.update(out, runner.execute(out), None, 0.0)
        assert s.num_preemptions > 0
        if mode == "swap":
            assert s.num_swapped_out_pages > 0 and s.num_swapped_in_pages == s.num_swapped_out_pages
            assert s.num_recomputed_tokens == 0
        else:
            assert s.num_recomputed_tokens > 0 and s.num_swapped_out_pages == 0
