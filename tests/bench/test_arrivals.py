"""Tests for cbjax.bench.arrivals: offline, Poisson, gamma and trace arrival times."""

import math

import numpy as np
import pytest

from cbjax.bench.arrivals import arrival_times


def cv(x):
    return np.std(x) / np.mean(x)


def test_offline_and_infinite_rate_arrive_at_zero():
    assert np.array_equal(arrival_times(5, "offline"), np.zeros(5))
    rng = np.random.default_rng(0)
    assert np.array_equal(arrival_times(5, "poisson", rng=rng, request_rate=math.inf), np.zeros(5))


def test_poisson_gaps_have_mean_one_over_rate_and_cv_one():
    t = arrival_times(20001, "poisson", rng=np.random.default_rng(1), request_rate=4.0)
    assert t[0] == 0.0 and np.all(np.diff(t) >= 0)
    gaps = np.diff(t)
    assert np.mean(gaps) == pytest.approx(0.25, rel=0.03)
    assert cv(gaps) == pytest.approx(1.0, rel=0.03)


@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_gamma_gaps_keep_the_rate_and_have_cv_one_over_sqrt_burstiness(burstiness):
    t = arrival_times(20001, "gamma", rng=np.random.default_rng(2), request_rate=2.0, burstiness=burstiness)
    gaps = np.diff(t)
    assert np.mean(gaps) == pytest.approx(0.5, rel=0.05)
    assert cv(gaps) == pytest.approx(1 / math.sqrt(burstiness), rel=0.08)


def test_gamma_with_burstiness_one_is_exactly_poisson():
    a = arrival_times(100, "gamma", rng=np.random.default_rng(3), request_rate=3.0, burstiness=1.0)
    b = arrival_times(100, "poisson", rng=np.random.default_rng(3), request_rate=3.0)
    assert np.array_equal(a, b)


def test_trace_arrivals_are_shifted_to_zero_and_sorted():
    assert arrival_times(3, "trace", trace=[5.0, 4.0, 7.5, 100.0]).tolist() == [0.0, 1.0, 3.5]
    with pytest.raises(ValueError, match="fewer than num_requests"):
        arrival_times(3, "trace", trace=[1.0])
