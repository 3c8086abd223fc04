"""Tests for cbjax.bench.lengths: the prompt / output length distributions."""

import math

import numpy as np
import pytest

from cbjax.bench.lengths import LengthSpec


def test_lognormal_median_and_clipping():
    spec = LengthSpec("lognormal", median=200, sigma=0.5, min=50, max=600)
    x = spec.sample(np.random.default_rng(0), 20000)
    assert x.dtype == np.int64
    assert np.median(x) == pytest.approx(200, rel=0.03)
    assert x.min() == 50 and x.max() == 600  # sigma 0.5 reaches both clip bounds in 20k draws


def test_lognormal_mean_parameterisation():
    x = LengthSpec("lognormal", mean=100, sigma=0.5).sample(np.random.default_rng(0), 20000)
    assert np.mean(x) == pytest.approx(100, rel=0.03)
    assert np.median(x) == pytest.approx(100 * math.exp(-0.125), rel=0.03)


def test_uniform_is_inclusive_and_fixed_is_constant():
    x = LengthSpec("uniform", low=3, high=6).sample(np.random.default_rng(0), 2000)
    assert set(x.tolist()) == {3, 4, 5, 6}
    assert LengthSpec("fixed", value=7).sample(np.random.default_rng(0), 4).tolist() == [7, 7, 7, 7]


def test_scaled_multiplies_lengths_but_not_sigma():
    s = LengthSpec("lognormal", median=256, sigma=0.6, min=16, max=1024).scaled(0.125)
    assert (s.median, s.sigma, s.min, s.max) == (32, 0.6, 2, 128)
    assert LengthSpec("uniform", low=1, high=10).scaled(0.01) == LengthSpec("uniform", low=1, high=1)
