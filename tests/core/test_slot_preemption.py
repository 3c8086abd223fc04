"""Preemption for a slot (issue 38, point 5): every slot taken, pages to spare, and a more important request
arrives. With the policy option `preempt_for_slot` (on by default) it takes the least important running request's
slot in the very next step; with it off it waits until a slot frees. The preempted request resumes and finishes
with exactly the tokens it would have had (the fake runner's tokens depend on the KV read back through the page
tables, so a lost or corrupted context shows in them)."""

import dataclasses

import pytest

from cbjax.core import Request, SamplingParams, VirtualClock
from cbjax.core.policy_zoo import POLICIES, make_policy
from tests.core.fake_runner import FakeRunner, reference
from tests.core.scheduler_setup import FlatConfig, make_scheduler

VOCAB = 40
# Two slots and 64 pages of 4 tokens: the slots run out long before the pages.
SLOTS_FULL = FlatConfig(max_num_seqs=2, max_num_batched_tokens=64, page_size=4, num_pages=64, max_model_len=64)
# Options under which the newcomer below outranks both running requests, and they are preemptible by it:
# priority by class, edf by its earlier deadline, srpt_oracle by its fewer remaining tokens, mlfq by its higher
# level (a short prompt, while the long ones sank with quantum 1), three_level as a new prompt against sequences
# demoted after their first token.
RANKED_FIRST = {
    "priority": dict(aging_s=None),
    "edf": {},
    "srpt_oracle": {},
    "mlfq": dict(quantum=1, starvation_s=None),
    "three_level": dict(demote_after=0),
}
ARRIVES_AT_STEP = 4


def request(rid: str, prompt: list[int], max_tokens: int, priority: int, order: int, now: float, deadline=None):
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Request(rid, prompt, params, now, seed=0, arrival_order=order, priority=priority, deadline=deadline)


def run(config: FlatConfig, arrivals: dict[int, list[tuple]]) -> tuple[dict, list[dict]]:
    """Run the scheduler on the fake runner to the end. `arrivals`: step -> [(id, prompt, max_tokens, priority,
    deadline slack or None)], added before that step. Returns the requests by id and, per step, the ids
    scheduled, the ids preempted, the running count and the free pages before the step."""
    clock = VirtualClock()
    s = make_scheduler(config, clock)
    runner = FakeRunner(s, VOCAB)
    reqs, steps, order = {}, [], 0
    while order == 0 or s.has_unfinished() or any(k >= len(steps) for k in arrivals):
        for rid, prompt, max_tokens, prio, slack in arrivals.get(len(steps), []):
            deadline = None if slack is None else clock.now() + slack
            reqs[rid] = request(rid, prompt, max_tokens, prio, order, clock.now(), deadline)
            s.add(reqs[rid])
            order += 1
        before = dict(running=len(s.running), free_pages=s.pool.num_free)
        out = s.schedule()
        tokens = runner.execute(out)
        clock.advance(0.01)
        s.update(out, tokens, None, clock.now())
        s.pool.check_consistent()
        scheduled = [q.request.request_id for q in out.seqs]
        steps.append(dict(before, scheduled=scheduled, preempted=[r.request_id for r in out.preempted]))
        assert len(steps) < 500, "requests did not finish"
    for r in reqs.values():
        assert r.is_finished
        assert r.output_token_ids == reference(list(r.prompt_token_ids), r.params.max_tokens, VOCAB, None, 64)
    assert s.pool.num_free == config.num_pages
    return reqs, steps


def slots_full_workload() -> dict[int, list[tuple]]:
    """Two long low-priority requests fill both slots; a short high-priority one arrives while they decode."""
    low = [(f"low{i}", [3 + i, 5, 7, 11, 13, 17, 19], 12, 1, None) for i in range(2)]
    return {0: low, ARRIVES_AT_STEP: [("high", [23, 29, 31], 2, 0, 0.001)]}


@pytest.mark.parametrize("policy", sorted(RANKED_FIRST))
def test_a_more_important_arrival_takes_a_slot_at_once_with_the_option_on(policy):
    config = dataclasses.replace(SLOTS_FULL, policy=policy, policy_options=RANKED_FIRST[policy])
    reqs, steps = run(config, slots_full_workload())
    arrival = steps[ARRIVES_AT_STEP]
    assert arrival["running"] == config.max_num_seqs and arrival["free_pages"] > 8  # slots full, pages free
    assert "high" in arrival["scheduled"]
    assert arrival["preempted"] == ["low1"]  # the least important: the later of two equal running requests
    assert reqs["low1"].num_preemptions == 1 and reqs["low0"].num_preemptions == 0
    assert sum(len(st["preempted"]) for st in steps) == 1


@pytest.mark.parametrize("policy", sorted(RANKED_FIRST))
def test_with_the_option_off_it_waits_for_a_slot_to_free(policy):
    options = dict(RANKED_FIRST[policy], preempt_for_slot=False)
    config = dataclasses.replace(SLOTS_FULL, policy=policy, policy_options=options)
    reqs, steps = run(config, slots_full_workload())
    assert not any(st["preempted"] for st in steps)
    first = next(i for i, st in enumerate(steps) if "high" in st["scheduled"])
    assert first > ARRIVES_AT_STEP
    # It got the first slot that freed: both long requests finished in the step before.
    assert reqs["low0"].metrics.finished_time == reqs["low1"].metrics.finished_time
    assert all(not ({"low0", "low1"} & set(st["scheduled"])) for st in steps[first:])


def test_with_the_option_off_a_waiting_request_still_preempts_for_pages():
    # A free slot but too few free pages: preemption for pages is not the option's business.
    config = dataclasses.replace(
        SLOTS_FULL,
        max_num_seqs=4,
        num_pages=8,
        policy="priority",
        policy_options=dict(aging_s=None, preempt_for_slot=False),
    )
    low = [("low", list(range(3, 23)), 10, 1, None)]  # 20 prompt tokens: 5 of the 8 pages, then 6 while decoding
    _, steps = run(config, {0: low, ARRIVES_AT_STEP: [("high", list(range(3, 15)), 2, 0, None)]})
    arrival = steps[ARRIVES_AT_STEP]
    assert arrival["running"] < config.max_num_seqs and arrival["free_pages"] < 3  # needs 3 for its 12 tokens
    assert arrival["preempted"] == ["low"] and "high" in arrival["scheduled"]


def test_the_option_is_on_by_default_and_validated():
    for name in RANKED_FIRST:
        assert make_policy(name).preempt_for_slot is True
        assert make_policy(name, {"preempt_for_slot": False}).preempt_for_slot is False
        with pytest.raises(ValueError, match=f"{name} preempt_for_slot must be True or False"):
            make_policy(name, {"preempt_for_slot": "no"})
    # The policies whose waiting requests never preempt have no such option: asking for it is an error.
    for name in sorted(set(POLICIES) - set(RANKED_FIRST)):
        with pytest.raises(ValueError, match="takes no option"):
            make_policy(name, {"preempt_for_slot": True})
