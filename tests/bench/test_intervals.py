"""The interval arithmetic of cbjax/bench/intervals.py on data whose answer is known."""

import math

import numpy as np
import pytest

from cbjax.bench.intervals import format_interval, median_interval, paired_ratio_interval, significant


def test_two_values_give_the_exact_bootstrap_bounds():
    # Resampling [a, b] gives medians a, (a + b) / 2, b with probabilities 1/4, 1/2, 1/4: the 2.5% and 97.5%
    # quantiles are a and b.
    iv = median_interval([10.0, 20.0])
    assert (iv.median, iv.low, iv.high, iv.n) == (15.0, 10.0, 20.0, 2)


def test_a_constant_sample_has_a_point_interval():
    iv = median_interval([3.0] * 7)
    assert (iv.median, iv.low, iv.high) == (3.0, 3.0, 3.0)


def test_the_interval_holds_the_median_and_stays_within_the_sample():
    values = [5.0, 1.0, 4.0, 2.0, 3.0]
    iv = median_interval(values)
    assert iv.median == 3.0 and 1.0 <= iv.low <= 3.0 <= iv.high <= 5.0
    assert median_interval(values, seed=0) == iv  # seeded: reproducible from the raw records


def test_fewer_than_two_values_have_no_bounds_and_nothing_is_significant():
    assert math.isnan(median_interval([]).median)
    one = median_interval([2.0])
    assert one.median == 2.0 and not one.known and not one.excludes(100.0)
    assert not significant(paired_ratio_interval([2.0], [1.0]))
    assert format_interval(one) == "2"


def test_non_finite_values_and_zero_baselines_are_left_out():
    iv = median_interval([1.0, float("nan"), 3.0, float("inf")])
    assert iv.n == 2 and iv.median == 2.0
    ratio = paired_ratio_interval([2.0, 4.0, 6.0], [1.0, 0.0, 3.0])
    assert ratio.n == 2 and ratio.median == 2.0


def test_a_policy_compared_with_itself_is_never_significant():
    rng = np.random.default_rng(1)
    for _ in range(50):
        runs = list(rng.lognormal(0.0, 0.5, size=rng.integers(2, 9)))
        ratio = paired_ratio_interval(runs, runs)
        assert (ratio.median, ratio.low, ratio.high) == (1.0, 1.0, 1.0)
        assert not significant(ratio)


def test_a_consistent_difference_is_significant_and_noise_around_one_is_not():
    base = [100.0, 80.0, 120.0, 90.0, 110.0]
    faster = [1.5 * b for b in base]  # the machine's drift is shared: every paired ratio is 1.5
    assert significant(paired_ratio_interval(faster, base))
    mixed = [b * r for b, r in zip(base, (0.9, 1.1, 0.95, 1.05, 1.0))]
    assert not significant(paired_ratio_interval(mixed, base))


def test_the_interval_covers_the_true_median_about_as_often_as_it_claims():
    # Lognormal samples of 15: the true median is exp(0) = 1. A percentile bootstrap of a median undercovers a
    # little at small n; across 400 samples it must cover at least 88% of the time, and not (near) always.
    rng = np.random.default_rng(7)
    covered = sum(median_interval(rng.lognormal(0.0, 1.0, 15), seed=i).excludes(1.0) is False for i in range(400))
    assert 0.88 * 400 <= covered <= 0.995 * 400


def test_bad_arguments_are_value_errors():
    with pytest.raises(ValueError, match="confidence"):
        median_interval([1.0, 2.0], confidence=1.0)
    with pytest.raises(ValueError, match="resamples"):
        median_interval([1.0, 2.0], resamples=0)
    with pytest.raises(ValueError, match="equal lengths"):
        paired_ratio_interval([1.0], [1.0, 2.0])


def test_format_interval():
    assert format_interval(median_interval([10.0, 20.0])) == "15 [10, 20]"
    assert format_interval(median_interval([])) == "-"


def test_a_ratio_that_is_one_up_to_rounding_is_not_significant():
    a = [10.0, 10.0, 10.0]
    b = [x * (1 + 1e-15) for x in a]
    assert not significant(paired_ratio_interval(b, a))
