"""The length predictors (cbjax/core/length_predictor.py) and the length-aware policies (cbjax/core/length_aware.py,
sjf and srpt_oracle in policy_zoo.py).

The fast path of each length-aware policy (waiting_key + rank_sorted) schedules exactly as its plain `rank`, step by
step, with every predictor (hypothesis, in lockstep as tests/core/test_fast_ranking.py does for the other policies);
sjf with a predictor keeps the invariants of tests/core/test_policy_invariants.py; and each policy orders a few
hand-made requests as its definition says.
"""

import dataclasses
import math
import statistics

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cbjax.core import Request, SamplingParams, VirtualClock
from cbjax.core.length_aware import HRRNPolicy, ResidualSJFPolicy, SLOAwarePolicy
from cbjax.core.length_predictor import LearnedPredictor, NoisyPredictor, make_length_predictor
from cbjax.core.policy import Policy, SortedWaiting, by_admission
from cbjax.core.policy_zoo import make_policy
from cbjax.core.request import FinishReason, RequestStatus
from tests.core.fake_runner import FakeRunner
from tests.core.scheduler_setup import FlatConfig, make_scheduler
from tests.core.test_fast_ranking import run_both
from tests.core.test_policy_invariants import VOCAB, cases, check_step, length_options, run_case

LENGTH_AWARE = ("sjf", "srpt_oracle", "residual_sjf", "hrrn", "slo_aware")


def _request(rid, prompt_len, max_tokens, arrival=0.0, order=0, tenant="default") -> Request:
    return Request(rid, [5] * prompt_len, SamplingParams(max_tokens=max_tokens), arrival, 0, order, tenant=tenant)


# ---- predictors ----------------------------------------------------------------------------------------------------
def test_noisy_predictions_are_fixed_by_seed_and_request_id():
    reqs = [_request(f"req-{i}", 8, 1000) for i in range(50)]
    a, b, c = NoisyPredictor(0.5, seed=1), NoisyPredictor(0.5, seed=1), NoisyPredictor(0.5, seed=2)
    assert [a.predict(r) for r in reqs] == [b.predict(r) for r in reqs]  # another process, engine or simulator
    assert [a.predict(r) for r in reqs] != [c.predict(r) for r in reqs]
    assert all(NoisyPredictor(0.0).predict(r) == 1000 for r in reqs)  # sigma 0 is the oracle


def test_noisy_error_is_log_normal_with_the_given_sigma():
    for sigma in (0.25, 1.0):
        p = NoisyPredictor(sigma, seed=3)
        logs = [math.log(p.predict(_request(f"req-{i}", 8, 100_000)) / 100_000) for i in range(4000)]
        assert abs(statistics.fmean(logs)) < 0.05 * sigma + 0.01
        assert statistics.stdev(logs) == pytest.approx(sigma, rel=0.05)


def test_learned_predictor_starts_from_its_prior_and_fits_by_tenant_and_prompt_bucket():
    p = LearnedPredictor(prior_tokens=50)
    assert p.predict(_request("x", 10, 999)) == 50  # never max_tokens
    for i, n in enumerate(range(5, 13)):  # tenant a, prompts of 10 tokens (bucket [8, 16)): outputs 5..12
        r = _request(f"a{i}", 10, 999, tenant="a")
        r.output_token_ids = [7] * n
        r.finish_reason = FinishReason.LENGTH
        p.observe(r)
    assert p.predict(_request("y", 12, 999, tenant="a")) == 9  # the bucket's median
    assert p.predict(_request("y", 12, 999, tenant="b")) == 9  # no data for b: every tenant's
    for i in range(8):
        r = _request(f"b{i}", 100, 999, tenant="b")
        r.output_token_ids = [7] * 100
        r.finish_reason = FinishReason.STOP
        p.observe(r)
    assert p.predict(_request("z", 100, 999, tenant="b")) == 100
    assert p.predict(_request("z", 12, 999, tenant="a")) == 9
    aborted = _request("gone", 10, 999, tenant="a")
    aborted.finish_reason = FinishReason.ABORT
    p.observe(aborted)
    assert len(p.samples[("a", LearnedPredictor.bucket(10))]) == 8  # an abort says nothing of the length


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(kind="psychic"), "length_predictor must be one of"),
        (dict(kind="noisy"), "needs sigma"),
        (dict(kind="noisy", sigma=-0.1), "sigma must be"),
        (dict(kind="oracle", sigma=0.5), "sigma is an option of the noisy"),
        (dict(kind="noisy", sigma=0.5, prior_tokens=3), "prior_tokens is an option of the learned"),
        (dict(kind="learned", seed=4), "predictor_seed is an option of the noisy"),
        (dict(kind="learned", prior_tokens=0), "prior_tokens must be"),
    ],
)
def test_bad_predictor_options_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_length_predictor(**kwargs)


def test_bad_policy_options_are_named():
    with pytest.raises(ValueError, match="need a length_predictor"):
        make_policy("sjf", {"sigma": 0.5})
    with pytest.raises(ValueError, match="prefill_s_per_token"):
        make_policy("hrrn", {"prefill_s_per_token": 0.0})
    with pytest.raises(ValueError, match="ttft_slo_s"):
        make_policy("slo_aware", {"ttft_slo_s": -1.0})


# ---- the orders, by hand ---------------------------------------------------------------------------------------
class FakeView:
    """The SchedulerView a policy reads: here only the prefix cache, as a table request id -> cached tokens."""

    def __init__(self, cached: dict[str, int] | None = None):
        self.cached = cached
        self.running, self.waiting, self.max_num_seqs = (), (), 8

    @property
    def prefix_caching(self) -> bool:
        return self.cached is not None

    def cached_prefix_tokens(self, req: Request) -> int:
        return self.cached.get(req.request_id, 0)


def orders(policy: Policy, waiting: list[Request], now: float) -> list[str]:
    """The waiting requests' order by `rank` and by the fast path (asserted equal)."""
    for r in waiting:
        policy.on_arrival(r, r.metrics.arrival_time)
    plain = [r.request_id for r in policy.rank([], waiting, now)]
    fast = policy.rank_sorted([], SortedWaiting.of(waiting, policy.waiting_key), now)
    assert [r.request_id for r in fast.order] == plain
    return plain


def test_residual_sjf_counts_the_prefix_cache_and_the_predicted_output():
    cached_long = _request("cached_long", 100, 4, order=0)
    short = _request("short", 20, 4, order=1)
    long_output = _request("long_output", 10, 50, order=2)
    p = ResidualSJFPolicy()
    p.attach(FakeView())  # no cache: 104, 24, 60 tokens of work
    assert orders(p, [cached_long, short, long_output], 0.0) == ["short", "long_output", "cached_long"]
    p.attach(FakeView({"cached_long": 96}))  # 8 tokens left
    assert orders(p, [cached_long, short, long_output], 0.0) == ["cached_long", "short", "long_output"]


def test_hrrn_lets_a_long_request_that_waited_pass_and_then_a_short_newcomer_catch_up():
    p = HRRNPolicy(prefill_s_per_token=1e-3, decode_s_per_token=0.0)
    p.attach(FakeView())
    long = _request("long", 1000, 1, arrival=0.0, order=0)  # 1 s of service
    short = _request("short", 10, 1, arrival=10.0, order=1)  # 0.01 s
    assert orders(p, [long, short], 10.0) == ["long", "short"]  # ratios 11 and 1
    assert orders(p, [long, short], 10.5) == ["short", "long"]  # 11.5 and 51


def test_slo_aware_serves_least_slack_first_and_the_already_late_last():
    p = SLOAwarePolicy(ttft_slo_s=1.0, prefill_s_per_token=0.01, late_last=True)
    p.attach(FakeView())
    early = _request("early", 10, 1, arrival=0.0, order=0)  # latest start 0.9
    big = _request("big", 50, 1, arrival=0.2, order=1)  # 0.2 + 1 - 0.5 = 0.7
    late = _request("late", 10, 1, arrival=0.7, order=2)  # 1.6
    assert orders(p, [early, big, late], 0.0) == ["big", "early", "late"]
    assert orders(p, [early, big, late], 0.95) == ["late", "big", "early"]  # big and early can no longer make it
    p.late_last = False
    assert orders(p, [early, big, late], 0.95) == ["big", "early", "late"]


def test_slo_aware_with_an_e2e_target_reads_the_predicted_output():
    p = SLOAwarePolicy(ttft_slo_s=10.0, e2e_slo_s=5.0, prefill_s_per_token=0.0, decode_s_per_token=0.01)
    p.attach(FakeView())
    a = _request("long_output", 10, 400, arrival=0.0, order=0)  # latest start 5 - 4 = 1
    b = _request("short_output", 10, 10, arrival=0.0, order=1)  # 4.9
    assert orders(p, [b, a], 0.0) == ["long_output", "short_output"]


def test_the_scheduler_tells_the_policy_of_every_finished_request():
    finished = []

    class Recording(Policy):
        def rank(self, running, waiting, now):
            return by_admission(running) + sorted(waiting, key=lambda r: r.arrival_order)

        def on_finish(self, req, now):
            finished.append((req.request_id, req.finish_reason))

    s = make_scheduler(FlatConfig(max_num_seqs=2, num_pages=64, page_size=4, max_model_len=64), VirtualClock(),
                       Recording())  # fmt: skip
    runner = FakeRunner(s, VOCAB)
    reqs = [Request(f"r{i}", [3 + i] * 6, SamplingParams(max_tokens=4, ignore_eos=True), 0.0, 0, i) for i in range(3)]
    for r in reqs:
        s.add(r)
    s.abort(reqs[2])
    while s.has_unfinished():
        out = s.schedule()
        s.update(out, runner.execute(out), None, 0.0)
    assert sorted(finished) == [("r0", FinishReason.LENGTH), ("r1", FinishReason.LENGTH), ("r2", FinishReason.ABORT)]


# ---- the fast path against `rank`, and sjf's invariants with predictors --------------------------------------------
REFERENCE_RANK = {  # sjf and srpt_oracle have no `rank` of their own: their order, written plainly
    "sjf": lambda p, running, waiting, now: (
        by_admission(running) + sorted(waiting, key=lambda r: (p.job_tokens(r), r.arrival_order))
    ),
    "srpt_oracle": lambda p, running, waiting, now: sorted(
        [*running, *waiting], key=lambda r: (p.remaining(r), r.arrival_order)
    ),
    "residual_sjf": ResidualSJFPolicy.rank,
    "hrrn": HRRNPolicy.rank,
    "slo_aware": SLOAwarePolicy.rank,
}


def general_twin(policy: Policy) -> Policy:
    """The same policy on the general path: no waiting_key, ranked by REFERENCE_RANK every step."""
    cls = type(policy)
    policy.__class__ = type(f"General{cls.__name__}", (cls,), {"waiting_key": None, "rank": REFERENCE_RANK[cls.name]})
    return policy


@st.composite
def length_aware_cases(draw):
    case = draw(cases())
    policy = draw(st.sampled_from(LENGTH_AWARE))
    options = {"victim": case.policy_options["victim"], **draw(length_options(policy if policy != "sjf" else "hrrn"))}
    if policy == "sjf":  # any predictor, or none
        options = {k: v for k, v in options.items() if k not in ("decode_s_per_token",)}
        if draw(st.booleans()):
            options = {"victim": options["victim"]}
    if policy in ("hrrn", "slo_aware"):
        options["prefill_s_per_token"] = draw(st.sampled_from([1e-4, 1e-3]))
    requests = list(case.requests)  # longer streams: queues a few deep, where the order matters
    for j in range(draw(st.integers(0, 20))):
        requests.append((j % 15,) + requests[j % len(requests)][1:])
    config = dataclasses.replace(case.config, policy=policy)
    return dataclasses.replace(case, config=config, policy_options=options, requests=requests)


def lockstep_policies(config):
    """The policy as it is and its general twin (ranked by REFERENCE_RANK every step)."""
    fast = make_policy(config.policy, config.policy_options)
    return fast, general_twin(make_policy(config.policy, config.policy_options))


def run_lockstep(case) -> None:
    """A fast-path and a general-path scheduler on the same requests (tests/core/test_fast_ranking.py's lockstep):
    every step's batch equal, invariants kept, every request finished."""
    steps, requests = run_both(case, lockstep_policies, after_update=check_step)
    assert steps < 2000, "requests did not finish"  # (run_both stops at 2000 steps)
    assert all(r.status is RequestStatus.FINISHED for r in requests)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(length_aware_cases())
def test_the_fast_path_schedules_exactly_as_rank(case):
    run_lockstep(case)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases(), st.sampled_from(["oracle", "noisy", "learned"]))
def test_sjf_with_a_predictor_finishes_everything_with_reference_tokens(case, kind):
    options = {"length_predictor": kind, **({"sigma": 1.0} if kind == "noisy" else {})}
    run_case(dataclasses.replace(case, config=dataclasses.replace(case.config, policy="sjf"), policy_options=options))
