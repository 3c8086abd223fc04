"""The "Writing a policy" example of docs/policies.md: a user policy registered by name works end to end."""

import pytest

from cbjax.core import Request, SamplingParams, VirtualClock
from cbjax.core.policy import Policy, by_admission
from cbjax.core.policy_zoo import POLICIES, FCFSPolicy, make_policy
from tests.core.scheduler_setup import FlatConfig, make_scheduler
from tests.core.test_policy_invariants import Case, run_case


class LongestPromptFirst(Policy):
    """Running sequences keep going; waiting ones are admitted longest prompt first."""

    name = "longest_prompt_first"

    def rank(self, running, waiting, now):
        return by_admission(running) + sorted(waiting, key=lambda r: (-r.num_prompt_tokens, r.arrival_order))


@pytest.fixture
def registered():
    POLICIES[LongestPromptFirst.name] = LongestPromptFirst
    yield
    del POLICIES[LongestPromptFirst.name]


def test_a_registered_policy_orders_admission(registered):
    s = make_scheduler(
        FlatConfig(
            max_num_seqs=1,
            max_num_batched_tokens=64,
            page_size=4,
            num_pages=32,
            max_model_len=64,
            policy="longest_prompt_first",
        ),
        VirtualClock(),
    )
    for i, n in enumerate([3, 9, 5]):
        s.add(Request(f"r{n}", [5] * n, SamplingParams(max_tokens=1), 0.0, 0, i))
    order = []
    while s.has_unfinished():
        out = s.schedule()
        order += [q.request.request_id for q in out.seqs]
        s.update(out, [7] * len(out.seqs), None, 0.0)
    assert order == ["r9", "r5", "r3"]


def test_a_registered_policy_keeps_the_invariants(registered):
    cfg = FlatConfig(
        max_num_seqs=3,
        max_num_batched_tokens=8,
        page_size=4,
        num_pages=10,
        max_model_len=32,
        policy="longest_prompt_first",
        preemption_mode="swap",
        num_host_pages=6,
        enable_prefix_caching=True,
    )
    reqs = [(i % 3, [1 + i % 4] * (4 + (3 * i) % 17), 10, 0, "a", None, None) for i in range(8)]
    run_case(Case(cfg, {}, reqs))


def test_unknown_policy_options_are_errors():
    with pytest.raises(ValueError, match="takes no option"):
        make_policy("priority", {"agingg_s": 1.0})
    with pytest.raises(ValueError, match="victim must be one of"):
        make_policy("fcfs", {"victim": "random"})
    assert make_policy("edf", {"class_slack_s": {"0": 2.0}}).class_slack_s == {0: 2.0}


class MostRecentEviction(FCFSPolicy):
    """fcfs that overwrites the most recently released cached page first (the eviction hook)."""

    name = "mru_eviction"

    def choose_eviction(self, evictable):
        *_, last = evictable
        return last


def test_the_eviction_hook_is_used_and_keeps_the_invariants():
    POLICIES[MostRecentEviction.name] = MostRecentEviction
    try:
        cfg = FlatConfig(
            max_num_seqs=2,
            max_num_batched_tokens=8,
            page_size=2,
            num_pages=12,
            max_model_len=20,
            policy="mru_eviction",
            enable_prefix_caching=True,
        )
        # Distinct prompts through a small pool: every admission past the first few evicts cached pages.
        reqs = [(i, [1 + i] * 6 + [2] * i, 4, 0, "a", None, None) for i in range(8)]
        run_case(Case(cfg, {}, reqs))
        s = make_scheduler(cfg, VirtualClock())
        calls = []
        s.policy.choose_eviction = lambda pages: calls.append(list(pages)) or calls[-1][-1]
        for i, (_, prompt, m, *_rest) in enumerate(reqs):
            s.add(Request(f"r{i}", prompt, SamplingParams(max_tokens=m, ignore_eos=True), 0.0, 0, i))
        while s.has_unfinished():
            out = s.schedule()
            s.update(out, [5] * len(out.seqs), None, 0.0)
        assert calls and s.pool.num_evictions == len(calls)
    finally:
        del POLICIES[MostRecentEviction.name]
