"""The simulator-fidelity study (experiments/fidelity_study.py, experiments/fidelity_stats.py): its statistics on
known data, and one small study end to end (test-tiny, 2 policies, 2 rounds) written as JSON and rendered."""

import json
import math
import statistics

import pytest

from cbjax.sim import CalibratedCost, StepFeatures, save_profile
from experiments import fidelity_stats as fs
from experiments import fidelity_study as study

A = StepFeatures(padded_tokens=16, num_tokens=3, decode_tokens=3, num_seqs=3, num_sampling_seqs=3, sum_context=30)
B = StepFeatures(padded_tokens=16, num_tokens=8, decode_tokens=8, num_seqs=8, num_sampling_seqs=8, sum_context=80)
P = StepFeatures(padded_tokens=32, num_tokens=20, prefill_tokens=20, num_seqs=1, num_sampling_seqs=1)


def test_bias_is_summed_predicted_over_summed_measured():
    assert fs.bias([1.0, 2.0, 3.0], [2.0, 2.0, 2.0]) == pytest.approx(0.0)  # per-step errors cancel in the sum
    assert fs.bias([2.0, 2.0], [1.0, 1.0]) == pytest.approx(1.0)
    assert fs.relative_errors([1.0, 2.0, 3.0], [2.0, 2.0, 2.0]) == pytest.approx([0.5, 0.0, 0.5])
    assert math.isnan(fs.bias([1.0], [0.0]))


def test_steps_are_classed_by_what_they_compute():
    assert fs.step_class(A) == "decode, 1-4 seqs"
    assert fs.step_class(B) == "decode, 5+ seqs"
    assert fs.step_class(P) == "with prefill"
    assert fs.step_class(StepFeatures(swap_bytes=1024)) == "swap only"


def test_the_engines_noise_is_over_groups_of_identical_steps_of_three_or_more():
    feats = [A, B, A, P, A, B, StepFeatures(**{**A.as_dict(), "sum_context": 31})]  # the last differs from A by one
    times = [1.0, 5.0, 1.1, 2.0, 0.9, 6.0, 1.0]
    groups = fs.repeated_groups(feats)
    assert groups == [[0, 2, 4]]  # B twice is too few to have a median to deviate from
    assert sorted(fs.step_noise(times, groups)) == pytest.approx([0.0, 0.1, 0.1])
    pred = [1.0] * len(feats)
    s = fs.step_stats(feats, times, pred)
    assert (s["steps"], s["repeated_steps"], s["repeated_groups"]) == (7, 3, 1)
    assert s["noise_median"] == pytest.approx(0.1) and s["noise_mean"] == pytest.approx(0.2 / 3)
    # On the repeated steps the cost model (1.0 each) misses by exactly the noise around the group's median.
    assert s["repeated_error_median"] == pytest.approx(abs(1 / 1.1 - 1))
    assert s["bias"] == pytest.approx(7.0 / sum(times) - 1)


def test_step_level_pools_runs_and_slices_by_class_and_policy():
    runs = [dict(policy="fcfs", features=[A, A, P], times=[1.0, 1.0, 4.0]),
            dict(policy="sjf", features=[A, B], times=[1.0, 2.0])]  # fmt: skip
    s = fs.step_level(runs, lambda f: 2.0 if f is P else 1.0)
    assert s["all"]["steps"] == 5 and s["all"]["bias"] == pytest.approx(6.0 / 9.0 - 1)
    assert s["by_class"]["with prefill"]["bias"] == pytest.approx(-0.5)
    assert s["by_class"]["decode, 1-4 seqs"]["repeated_groups"] == 1  # A three times, over two runs
    assert s["by_policy"]["sjf"]["bias"] == pytest.approx(2.0 / 3.0 - 1)
    assert s["by_policy"]["fcfs"]["time_share"] == pytest.approx(6.0 / 9.0)


@pytest.mark.parametrize(
    "real, sim, inside, ok",
    [
        ([100.0, 110.0, 120.0], 118.0, True, True),
        ([100.0, 110.0, 120.0], 120.5, False, True),  # outside the interval, within 10% of the median
        ([100.0, 110.0, 120.0], 125.0, False, False),  # +13.6%, outside
        ([100.0, 100.0, 100.0], 95.0, False, True),  # a zero-width interval: only the tolerance passes it
        ([100.0, 100.0, 100.0], 89.0, False, False),
    ],
)
def test_a_figure_passes_inside_the_real_interval_or_within_ten_percent(real, sim, inside, ok):
    c = fs.metric_check(real, sim)
    assert c["median"] == pytest.approx(sorted(real)[1])
    assert (c["inside"], c["ok"]) == (inside, ok)
    assert c["error"] == pytest.approx(sim / c["median"] - 1)


def test_kendalls_tau_counts_only_separable_pairs_with_a_known_reversal():
    real = dict(
        a=[10.0, 11.0, 12.0],
        b=[20.0, 21.0, 22.0],
        c=[10.5, 10.4, 12.5],  # a/c by round: 0.95, 1.06, 0.96: the runs cannot separate a and c
        d=[5.0, 5.5, 6.0],
    )
    sim = dict(a=12.0, b=20.0, c=11.0, d=11.5)  # a > c in the simulator against the real median a < c: not counted
    r = fs.ranking(real, sim)
    by_pair = {(p["a"], p["b"]): p for p in r["pair_list"]}
    assert not by_pair[("a", "c")]["separable"] and by_pair[("a", "c")]["sim_order"] is None
    assert [k for k, p in by_pair.items() if p["sim_order"] == "reversed"] == [("c", "d")]
    assert (r["pairs"], r["separable"], r["same_order"], r["reversed"], r["tied"]) == (6, 5, 4, 1, 0)
    assert r["tau"] == pytest.approx((4 - 1) / 5)


def test_a_policy_against_an_identical_one_is_never_separable_and_a_simulated_tie_orders_nothing():
    assert not fs.pair_order([1.0, 2.0, 3.0], [1.0, 2.0, 3.0], 5.0, 4.0)["separable"]
    tie = fs.pair_order([1.0, 1.1, 1.2], [2.0, 2.1, 2.2], 3.0, 3.0)
    assert tie["separable"] and tie["sim_order"] == "tie"
    k = fs.kendall([tie, dict(tie, sim_order="same")])
    assert (k["same_order"], k["reversed"], k["tied"], k["tau"]) == (1, 0, 1, 0.5)  # a tie: neither, yet tau < 1
    assert math.isnan(fs.kendall([])["tau"])


def _workload(bias: float, oks: list[bool], pairs: list[dict]) -> dict:
    return dict(steps=dict(all=dict(bias=bias)), metrics=dict(fcfs={f"m{i}": dict(ok=o) for i, o in enumerate(oks)}),
                ranking=dict(m0=dict(pair_list=pairs)))  # fmt: skip


def test_verdicts_say_by_how_much_a_target_is_missed():
    sep = dict(separable=True, sim_order="same")
    offline = _workload(0.02, [True] * 5, [sep])
    overload = _workload(-0.08, [True] * 4 + [False], [sep, dict(sep, sim_order="reversed")])
    v = fs.verdicts(dict(offline=offline, overload=overload))
    assert v["step_bias"]["worst_workload"] == "overload" and not v["step_bias"]["met"]
    assert v["step_bias"]["missed_by"] == pytest.approx(0.03)
    assert v["metric_figures"]["share"] == pytest.approx(0.9) and v["metric_figures"]["met"]
    assert not v["ranking"]["met"] and v["ranking"]["missed_by"] == 1 and v["ranking"]["tau"] == pytest.approx(1 / 3)
    none_separable = fs.verdicts(dict(offline=_workload(0.0, [True], [dict(separable=False, sim_order=None)])))
    assert none_separable["step_bias"]["met"] and not none_separable["ranking"]["met"]  # nothing shown is no pass


TINY_ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=16, num_pages=64, max_model_len=128)
TINY_WORKLOAD = dict(kind="synthetic", num_requests=10, seed=11, prompt_len=dict(dist="uniform", low=4, high=40),
                     output_len=dict(dist="uniform", low=2, high=12))  # fmt: skip


def test_a_small_study_end_to_end(tmp_path, capsys):
    profile = tmp_path / "fixed.json"
    save_profile(CalibratedCost({16: 2e-3}, {"num_tokens": 1e-5, "num_seqs": 1e-4}), str(profile), meta={"by": "test"})
    out = tmp_path / "study.json"
    argv = ["fidelity_study", "--repeats=2"]
    saved = study.study_command(str(profile), output=str(out), repeats=2, model="test-tiny", policies=("fcfs", "sjf"),
                                workload=TINY_WORKLOAD, engine=TINY_ENGINE, argv=argv)  # fmt: skip
    printed = capsys.readouterr().out
    assert json.loads(out.read_text()) == saved
    assert saved["command"] == "python -m experiments.fidelity_study --repeats=2" and saved["cpu"]
    assert saved["profile"] == dict(path=str(profile), kind="calibrated", meta={"by": "test"})
    assert list(saved["workloads"]) == ["offline", "near_saturation", "overload"]
    offline = saved["workloads"]["offline"]
    # Interleaved rounds: round 1 starts one policy later.
    assert [(r["round"], r["policy"]) for r in offline["runs"]] == [(0, "fcfs"), (0, "sjf"), (1, "sjf"), (1, "fcfs")]
    cap = saved["capacity"]
    fcfs_rates = [r["summary"]["request_throughput"] for r in offline["runs"] if r["policy"] == "fcfs"]
    assert cap["request_rate"] == pytest.approx(sorted(fcfs_rates)[0] / 2 + sorted(fcfs_rates)[1] / 2)
    assert saved["workloads"]["overload"]["request_rate"] == pytest.approx(1.3 * cap["request_rate"])
    for w in saved["workloads"].values():
        assert all(r["summary"]["num_completed"] == 10 for r in w["runs"])
        steps = w["steps"]["all"]
        assert steps["steps"] == sum(r["steps"] for r in w["runs"])
        assert steps["bias"] == pytest.approx(sum(r["predicted_s"] for r in w["runs"]) / steps["measured_s"] - 1)
        assert set(w["sim"]) == {"fcfs", "sjf"} and len(w["metrics"]["sjf"]) == len(fs.METRICS)
        assert all(len(r["pair_list"]) == 1 for r in w["ranking"].values())
        # A speed probe before every real run; the simulator ran the profile times their median.
        assert len(w["probes"]) == len(w["runs"]) == 4 and all(p["steps"] > 0 for p in w["probes"])
        assert w["scale"] == pytest.approx(statistics.median(p["measured_s"] / p["predicted_s"] for p in w["probes"]))
    assert saved["verdicts"]["metric_figures"]["figures"] == 3 * 2 * len(fs.METRICS)
    text = study.report(saved)
    assert text in printed
    assert "Step level" in text and "Metric level" in text and "Ranking" in text
    assert "| overload | sjf |" in text and "below the issue's 5 policies" in text
    assert sum(line.startswith("- ") for line in text.splitlines()) == 4
    assert "Speed probes (measured / predicted" in text and "over 4 probes" in text
