"""Multi-turn sessions: the `sessions` workload kind, its checks, and the closed loop of the online harness on a tiny
engine and on the simulator (turn k+1's prompt is turn k's prompt + what the engine generated + the new message,
released at turn k's finish + the think time)."""

import dataclasses
import itertools
import math

import numpy as np
import pytest

from cbjax import LLMEngine
from cbjax.bench.generators import ThinkTime
from cbjax.bench.metrics import RequestRecord, summarize, worst_share
from cbjax.bench.online import run_online
from cbjax.bench.requests import WorkloadRequest
from cbjax.bench.sessions import Arrivals, session_turns
from cbjax.bench.workload import make_workload
from cbjax.core import VirtualClock
from cbjax.sim import FixedCost

COST = 0.01  # virtual seconds per step
SHAPES = dict(max_num_seqs=4, max_num_batched_tokens=16, num_pages=64, max_model_len=128)  # as test_online.py


def sessions_cfg(**over):
    cfg = dict(kind="sessions", num_requests=8, seed=3, arrival="poisson", request_rate=20.0, prompt_len=12,
               message_len=dict(dist="uniform", low=3, high=9), output_len=dict(dist="uniform", low=2, high=6),
               num_turns=dict(dist="uniform", low=1, high=4), think_time_s=dict(dist="exponential", mean=0.05),
               vocab_size=200, max_model_len=128)  # fmt: skip
    return {**cfg, **over}


# ---- the workload -----------------------------------------------------------------------------------------------


def test_sessions_have_numbered_turns_and_one_shots_are_exact():
    wl = make_workload(sessions_cfg(num_requests=20, one_shot_fraction=0.25))
    one_shots = [r for r in wl if r.session_id is None]
    assert len(one_shots) == 5 and all(r.tenant == "one_shot" and r.request_id.startswith("one-") for r in one_shots)
    turns = session_turns(wl)
    assert len(turns) == 15
    for sid, group in turns.items():
        assert [r.request_id for r in group] == [f"{sid}-t{k}" for k in range(len(group))]
        assert group[0].think_time_s == 0.0 and all(r.think_time_s >= 0 for r in group)
        # A later turn's arrival_time: the earliest it could come, its session's start + the think times before it.
        starts = np.cumsum([r.think_time_s for r in group]) + group[0].arrival_time
        assert [r.arrival_time for r in group] == pytest.approx(starts.tolist())
        assert all(r.tenant == "session" for r in group)
    assert [r.arrival_time for r in wl] == sorted(r.arrival_time for r in wl)


def test_sessions_fit_max_model_len_and_the_rate_moves_only_the_starts():
    cfg = sessions_cfg(num_requests=30, num_turns=8, message_len=20, output_len=10, max_model_len=100)
    wl = make_workload(cfg)
    for group in session_turns(wl).values():
        context = 0
        for r in group:  # the whole conversation up to this answer: the first prompt, then message + answer each
            context += r.prompt_len + r.max_tokens
        assert context <= 100 and len(group) < 8  # 12 + 10 + k * 30 <= 100: the sessions were cut at 3 turns
    slower = make_workload({**cfg, "request_rate": 2.0})
    key = lambda w: {r.request_id: (r.prompt_token_ids, r.max_tokens, r.think_time_s) for r in w}
    assert key(slower) == key(wl) and [r.arrival_time for r in slower] != [r.arrival_time for r in wl]
    assert key(make_workload({**cfg, "seed": 4})) != key(wl)


def test_think_time_distributions():
    rng = np.random.default_rng(0)
    assert ThinkTime.from_config(1.5).sample(rng, 3).tolist() == [1.5] * 3
    for spec in (dict(dist="exponential", mean=2.0), dict(dist="lognormal", mean=2.0, sigma=1.0)):
        x = ThinkTime.from_config(spec).sample(np.random.default_rng(1), 200_000)
        assert x.min() >= 0 and x.mean() == pytest.approx(2.0, rel=0.03)


@pytest.mark.parametrize(
    "over, message",
    [
        (dict(num_turns=None), "num_turns is required"),
        (dict(message_len=None), "message_len is required"),
        (dict(think_time_s=-1.0), "think_time_s.value must be a number of seconds >= 0"),
        (dict(think_time_s=dict(dist="exponential")), "think_time_s.mean is required"),
        (dict(think_time_s=dict(dist="lognormal", mean=1.0)), "think_time_s.sigma must be"),
        (dict(think_time_s=dict(dist="gamma", mean=1.0)), "think_time_s.dist must be one of"),
        (dict(think_time_s="2s"), "think_time_s must be a number of seconds or a mapping"),
        (dict(one_shot_fraction=1.5), r"one_shot_fraction must be in \[0, 1\]"),
        (dict(num_turns=dict(dist="uniform", low=0, high=3)), "num_turns.low must be >= 1"),
    ],
)
def test_bad_session_config_names_the_field(over, message):
    with pytest.raises(ValueError, match=message):
        make_workload(sessions_cfg(**over))


def test_session_fields_need_the_sessions_kind():
    with pytest.raises(ValueError, match="need kind='sessions'"):
        make_workload(dict(kind="synthetic", num_requests=2, prompt_len=4, output_len=2, num_turns=3))


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(turn=-1, session_id="s"), "turn must be an integer >= 0"),
        (dict(turn=1.0, session_id="s"), "turn must be an integer >= 0"),
        (dict(turn=1, session_id="s", think_time_s=math.inf), "think_time_s must be a finite number"),
        (dict(turn=1, session_id="s", think_time_s=-0.5), "think_time_s must be a finite number"),
        (dict(turn=1), "it needs a session_id"),
        (dict(think_time_s=1.0), "it needs a session_id"),
        (dict(session_id="s", think_time_s=1.0), "first turn arrives by its arrival_time"),
    ],
)
def test_bad_session_fields_of_a_request(fields, message):
    with pytest.raises(ValueError, match=message):
        WorkloadRequest("r", 0.0, (5, 6), 2, **fields)


def test_a_session_needs_every_turn_from_zero():
    turns = [WorkloadRequest("a0", 0.0, (5,), 2, session_id="a"), WorkloadRequest("a2", 0.0, (5,), 2, session_id="a",
                                                                                   turn=2)]  # fmt: skip
    with pytest.raises(ValueError, match=r"session 'a' has turns \[0, 2\]"):
        Arrivals(turns)
    with pytest.raises(ValueError, match=r"session 'a' has turns \[0, 0\]"):
        Arrivals([turns[0], dataclasses.replace(turns[0], request_id="a0b")])


# ---- the closed loop ----------------------------------------------------------------------------------------------


def spy_prompts(engine) -> dict[str, list[int]]:
    """The prompt the engine was handed for each request id."""
    seen, add = {}, engine.add_request

    def add_request(request_id, prompt_token_ids, *args, **kwargs):
        seen[request_id] = list(prompt_token_ids)
        return add(request_id, prompt_token_ids, *args, **kwargs)

    engine.add_request = add_request
    return seen


def check_closed_loop(wl, result, prompts):
    """Every later turn: its prompt is the previous turn's prompt + that turn's output + its message, and it arrived
    exactly its think time after the previous turn finished (virtual clock)."""
    recs = {r.request_id: r for r in result.requests}
    assert all(r.finish_reason == "length" for r in recs.values()) and len(recs) == len(wl)
    later = 0
    for group in session_turns(wl).values():
        for prev, turn in itertools.pairwise(group):
            expected = prompts[prev.request_id] + result.output_token_ids[prev.request_id] + list(turn.prompt_token_ids)
            assert prompts[turn.request_id] == expected
            assert recs[turn.request_id].prompt_len == len(expected)
            assert recs[turn.request_id].turn == turn.turn
            released = recs[prev.request_id].finished_time + turn.think_time_s
            assert recs[turn.request_id].arrival_time == pytest.approx(released, abs=1e-9)
            assert recs[turn.request_id].first_scheduled_time >= released - 1e-9
            later += 1
    assert later >= 5  # the workload does have later turns to check


@pytest.mark.parametrize("policy", ["fcfs", "lpm"])
def test_closed_loop_on_a_tiny_engine(policy):
    wl = make_workload(sessions_cfg(one_shot_fraction=0.25))
    engine = LLMEngine("test-tiny", clock=VirtualClock(), policy=policy, enable_prefix_caching=True,
                       async_scheduling=False, **SHAPES)  # fmt: skip
    prompts = spy_prompts(engine)
    result = run_online(engine, wl, step_cost_s=COST)
    check_closed_loop(wl, result, prompts)
    # The conversation so far is in the cache when the next turn comes.
    assert sum(s.prefix_hit_tokens for s in result.steps) > 0
    summary = summarize(result.requests, result.steps)
    assert summary["later_turn_ttft_ms_p50"] > 0 and summary["first_turn_ttft_ms_p50"] > 0


def test_greedy_outputs_do_not_depend_on_the_policy():
    wl = make_workload(sessions_cfg(num_requests=6))
    outputs = []
    for policy, cache in (("fcfs", False), ("lpm", True)):
        engine = LLMEngine("test-tiny", clock=VirtualClock(), policy=policy, enable_prefix_caching=cache, **SHAPES)
        outputs.append(run_online(engine, wl, step_cost_s=COST).output_token_ids)
    assert outputs[0] == outputs[1] and len(outputs[0]) == len(wl)


def test_closed_loop_on_the_simulator():
    wl = make_workload(sessions_cfg(num_requests=12, one_shot_fraction=0.25, vocab_size=32000, max_model_len=1024,
                                    prompt_len=100, message_len=30, output_len=20))  # fmt: skip
    engine = LLMEngine("llama-tiny", runner="sim", cost_model=FixedCost(0.02), policy="lpm",
                       enable_prefix_caching=True, max_num_seqs=8, max_num_batched_tokens=128, num_pages=256,
                       max_model_len=1024)  # fmt: skip
    prompts = spy_prompts(engine)
    result = run_online(engine, wl)
    check_closed_loop(wl, result, prompts)
    assert sum(s.prefix_hit_tokens for s in result.steps) > 0


def test_a_refused_turn_ends_its_session():
    """The engine refuses turn 1 (its prompt is longer than max_model_len): turn 2 is never sent."""
    wl = [
        WorkloadRequest("a-t0", 0.0, (5,) * 8, 3, session_id="a"),
        WorkloadRequest("a-t1", 0.0, (6,) * 130, 3, session_id="a", turn=1, think_time_s=0.1),
        WorkloadRequest("a-t2", 0.0, (7,) * 4, 3, session_id="a", turn=2, think_time_s=0.1),
        WorkloadRequest("b", 0.5, (8,) * 8, 3),
    ]
    engine = LLMEngine("test-tiny", clock=VirtualClock(), async_scheduling=False, **SHAPES)
    result = run_online(engine, wl, step_cost_s=COST)
    recs = {r.request_id: r for r in result.requests}
    assert set(recs) == {"a-t0", "a-t1", "b"} and recs["a-t1"].finish_reason == "abort"
    assert recs["a-t1"].arrival_time == pytest.approx(recs["a-t0"].finished_time + 0.1)
    assert result.num_not_arrived == 1 and recs["b"].finish_reason == "length"


# ---- the TTFT tail ------------------------------------------------------------------------------------------------


def test_worst_share():
    assert worst_share([1.0] * 40) == pytest.approx(0.05)
    assert worst_share([1.0] * 38 + [31.0, 31.0]) == pytest.approx(62 / 100)
    assert worst_share([1.0, 3.0]) == pytest.approx(0.75)  # ceil(5% of 2) = 1 request
    assert math.isnan(worst_share([])) and math.isnan(worst_share([0.0, 0.0]))


def test_summary_splits_ttft_by_turn():
    recs = [RequestRecord(f"r{i}", 4, 1, 0.0, first_token_time=t, finished_time=t, finish_reason="length", turn=k)
            for i, (t, k) in enumerate([(1.0, 0), (3.0, 0), (0.5, 1), (0.5, 2)])]  # fmt: skip
    s = summarize(recs)
    assert s["first_turn_ttft_ms_mean"] == pytest.approx(2000) and s["later_turn_ttft_ms_p99"] == pytest.approx(500)
    assert s["ttft_ms_max"] == pytest.approx(3000) and s["ttft_worst5_share"] == pytest.approx(3 / 5)
