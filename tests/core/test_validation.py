"""The checks every public option goes through (cbjax/config/validation.py), and SamplingParams built on them."""

import math

import numpy as np
import pytest

from cbjax.config import validation as check
from cbjax.core.sampling_params import SamplingParams


@pytest.mark.parametrize("value", [0, 7, np.int64(3), np.int32(0), 2**40])
def test_integers_are_accepted_as_plain_ints(value):
    out = check.integer("n", value, 0)
    assert out == int(value) and type(out) is int


@pytest.mark.parametrize("value", [True, False, np.bool_(True), 2.0, 2.5, "3", None, [1], float("nan")])
def test_integers_refuse_bools_floats_text(value):
    with pytest.raises(ValueError, match=r"^n must be an integer >= 0, got .*\(\w+\)"):
        check.integer("n", value, 0)


def test_integer_ranges_name_the_bounds():
    with pytest.raises(ValueError, match=r"n must be an integer >= 1 and <= 4, got 5"):
        check.integer("n", 5, 1, 4)
    with pytest.raises(ValueError, match=r"n must be an integer >= 1 and < 4, got 4"):
        check.integer("n", 4, 1, 4, high_open=True)
    assert check.integer("n", 3, 1, 4, high_open=True) == 3


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf"), True, "1.0", None, 1j])
def test_reals_are_finite_numbers(value):
    with pytest.raises(ValueError, match="x must be a finite number"):
        check.real("x", value)


def test_reals_accept_ints_and_numpy_floats_and_check_open_bounds():
    assert check.real("x", 2) == 2.0 and type(check.real("x", np.float32(0.5))) is float
    with pytest.raises(ValueError, match=r"x must be a finite number > 0.0 and <= 1.0, got 0.0"):
        check.real("x", 0.0, 0.0, 1.0, low_open=True)
    assert check.real("x", 1.0, 0.0, 1.0, low_open=True) == 1.0


@pytest.mark.parametrize("value", [1, 0, "yes", None, 1.0])
def test_booleans_are_bools_only(value):
    with pytest.raises(ValueError, match="flag must be True or False"):
        check.boolean("flag", value)
    assert check.boolean("flag", np.bool_(False)) is False


def test_choices_compare_strings_only():
    assert check.choice("mode", "a", ("a", "b")) == "a"
    for bad in ("c", 1, ["a"], {"a": 1}):
        with pytest.raises(ValueError, match=r"mode must be one of \['a', 'b'\]"):
            check.choice("mode", bad, ("a", "b"))


@pytest.mark.parametrize(
    "value, message",
    [
        ([1.0, 2.5], "holds 1.0 \\(float\\)"),
        (b"abc", "sequence of integer token ids"),
        ("abc", "sequence of integer token ids"),
        ([1, True], "holds True \\(bool\\)"),
        ({1, 2}, "sequence of integer token ids"),
        (np.array([[1, 2]]), "sequence of integer token ids"),
        (np.array([1.0, 2.0]), "holds np.float64\\(1.0\\)"),
        ([3, -1], "outside"),
        ([3, 9], "outside the vocabulary \\[0, 8\\)"),
        (None, "sequence of integer token ids"),
        (5, "sequence of integer token ids"),
    ],
)
def test_token_ids_are_integer_sequences_in_the_vocabulary(value, message):
    with pytest.raises(ValueError, match=message):
        check.token_ids("prompt", value, 8)


def test_token_ids_accept_lists_tuples_and_numpy():
    assert check.token_ids("p", (1, 2), 8) == [1, 2]
    out = check.token_ids("p", np.array([3, 4], dtype=np.int32), 8)
    assert out == [3, 4] and all(type(t) is int for t in out)


# ------------------------------------------------------------------------------------------------ SamplingParams
@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(temperature=float("nan")), "temperature must be a finite number >= 0.0, got nan"),
        (dict(temperature=float("inf")), "temperature must be a finite number"),
        (dict(temperature="0.5"), "temperature must be a finite number >= 0.0, got '0.5' \\(str\\)"),
        (dict(seed=1.5), "seed must be an integer >= 0 and <= 4294967295, got 1.5 \\(float\\)"),
        (dict(seed=2**32), "seed must be an integer"),
        (dict(max_tokens=True), "max_tokens must be an integer >= 1, got True \\(bool\\)"),
        (dict(max_tokens=4.0), "max_tokens must be an integer"),
        (dict(top_p=float("nan")), "top_p must be a finite number > 0.0 and <= 1.0"),
        (dict(top_k=2.0), "top_k"),
        (dict(top_k=-2), "top_k"),
        (dict(stop_token_ids=[1.5]), "stop_token_ids must hold integer token ids"),
        (dict(stop_token_ids="7"), "stop_token_ids must be a sequence"),
        (dict(stop_token_ids=[-3]), "stop_token_ids: token ids outside"),
        (dict(ignore_eos="yes"), "ignore_eos must be True or False"),
    ],
)
def test_sampling_params_refuse_nonsense(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_sampling_params_store_plain_python_values():
    sp = SamplingParams(max_tokens=np.int64(4), temperature=np.float32(0.5), seed=np.uint32(7), stop_token_ids=[3])
    assert sp.max_tokens == 4 and type(sp.max_tokens) is int and type(sp.seed) is int
    assert math.isclose(sp.temperature, 0.5) and type(sp.temperature) is float
    assert sp.stop_token_ids == (3,) and hash(sp) == hash(SamplingParams(4, 0.5, 1.0, -1, 7, (3,)))
