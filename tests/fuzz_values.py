"""The values the fuzz tests (tests/test_fuzz_*.py, hypothesis) draw from: junk of every type a user might pass by
mistake, plausible sampling options, and what a SamplingParams that was built must hold.

CI runs a few hundred cases per test, the same ones every run; a long hunt runs many more with the same tests:
  CBJAX_FUZZ_EXAMPLES=20000 JAX_PLATFORMS=cpu python -m pytest -q tests/test_fuzz_*.py
"""

import math
import os

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from cbjax import SamplingParams
from cbjax.config.validation import is_integer

EXAMPLES = int(os.environ.get("CBJAX_FUZZ_EXAMPLES", "0")) or None
FUZZ = settings(
    max_examples=EXAMPLES or 150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    derandomize=EXAMPLES is None,  # CI: the same cases every run; a long hunt explores
)
VOCAB = 512  # test-tiny

# Anything a user might pass by mistake: every Python type the API meets, numpy scalars and arrays, odd floats.
junk = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=6),
    st.binary(max_size=4),
    st.lists(st.integers(-3, VOCAB + 3), max_size=5),
    st.lists(st.floats(allow_nan=True), max_size=3),
    st.tuples(st.integers(0, 9), st.text(max_size=2)),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    st.builds(np.int64, st.integers(-20, 600)),
    st.builds(np.float32, st.floats(-3, 3, width=32)),
    st.builds(np.bool_, st.booleans()),
    st.builds(lambda xs: np.array(xs), st.lists(st.integers(0, 600), max_size=4)),
    st.builds(lambda xs: np.array(xs), st.lists(st.floats(0, 9), max_size=3)),
    st.just(object()),
)


def maybe(valid):
    """Mostly plausible values, sometimes junk."""
    return st.one_of(valid, valid, junk)


sampling_kwargs = st.fixed_dictionaries(
    {},
    optional={
        "max_tokens": maybe(st.integers(-2, 12)),
        "temperature": maybe(st.sampled_from([0.0, 0.0, 0.5, 1.0, 2.0, 1e-30, 1e30])),
        "top_p": maybe(st.floats(0.0, 1.2)),
        "top_k": maybe(st.integers(-2, 600)),
        "seed": maybe(st.integers(-1, 2**32)),
        "stop_token_ids": maybe(st.lists(st.integers(-1, VOCAB + 1), max_size=3)),
        "ignore_eos": maybe(st.booleans()),
    },
)


def check_sampling_params(sp: SamplingParams) -> None:
    """What a SamplingParams that was built must hold."""
    assert is_integer(sp.max_tokens) and type(sp.max_tokens) is int and sp.max_tokens >= 1
    assert type(sp.temperature) is float and math.isfinite(sp.temperature) and sp.temperature >= 0
    assert type(sp.top_p) is float and 0 < sp.top_p <= 1
    assert type(sp.top_k) is int and sp.top_k >= -1
    assert sp.seed is None or (type(sp.seed) is int and 0 <= sp.seed < 2**32)
    assert isinstance(sp.stop_token_ids, tuple) and all(type(t) is int and t >= 0 for t in sp.stop_token_ids)
    assert type(sp.ignore_eos) is bool
    hash(sp)
