"""Fuzzing the options a request or an engine is built from (hypothesis): random SamplingParams and EngineConfig
options, and the server's request bodies, each built (holding what was given, as plain Python values) or refused
with a ValueError (a 400 for a body); no other exception escapes. No engine runs here: tests/test_fuzz_api.py serves.
"""

import math

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from cbjax import SamplingParams
from cbjax.engine_config import EngineConfig
from tests.fuzz_values import FUZZ, check_sampling_params, junk, sampling_kwargs


@FUZZ
@given(sampling_kwargs)
def test_sampling_params_build_or_raise_value_error(kwargs):
    try:
        sp = SamplingParams(**kwargs)
    except ValueError:
        return
    check_sampling_params(sp)


ENGINE_FIELDS = EngineConfig.option_defaults()
engine_kwargs = st.dictionaries(
    st.sampled_from([*ENGINE_FIELDS, "bogus_option"]),
    st.one_of(
        junk, st.integers(0, 64), st.sampled_from(["fcfs", "swap", "recompute", "xla", "auto", "full", "float32"])
    ),
    max_size=4,
)


@FUZZ
@given(engine_kwargs)
def test_engine_config_builds_or_raises_value_error(kwargs):
    kwargs.pop("compilation_cache", None)  # a random string is a folder it would create; checked in test_engine_api
    try:
        cfg = EngineConfig.from_options(kwargs)
    except ValueError:
        return
    options = cfg.options()
    for name, value in kwargs.items():  # what was given is what is stored, as a plain Python value
        stored = options[name]
        assert (
            stored == value
            or (isinstance(stored, float) and math.isclose(stored, float(value)))  # a huge int, as a float
            or (name == "policy_options" and not value and stored is None)
        )
        assert not isinstance(stored, np.generic)


# ---- the server's request bodies: every option parsed, mapped to SamplingParams, or refused (a 400) ----
def _server_bodies():
    from cbjax.serve.protocol import CHAT_FIELDS, COMPLETION_FIELDS

    plausible = st.one_of(
        st.integers(-3, 6),
        st.floats(-3, 3),
        st.booleans(),
        st.none(),
        st.lists(st.text(max_size=3), max_size=3),
        st.dictionaries(st.sampled_from(["5", "x", "-1", "99999"]), st.one_of(st.floats(-200, 200), junk), max_size=2),
        st.sampled_from(
            [
                {"type": "json_object"},
                {"type": "text"},
                {"type": "json_schema", "json_schema": {"schema": {"type": "object"}}},
                {"type": "json_schema"},
                {"type": "xml"},
            ]
        ),
    )
    return st.dictionaries(
        st.sampled_from(sorted((COMPLETION_FIELDS | CHAT_FIELDS) - {"prompt", "messages", "stream_options"})),
        st.one_of(plausible, junk),
        max_size=5,
    )


@FUZZ
@given(_server_bodies(), st.booleans())
def test_server_bodies_parse_to_sampling_params_or_get_a_400(body, chat):
    from cbjax.serve.protocol import ProtocolError, parse_chat, parse_completion

    try:
        if chat:
            req, _ = parse_chat({**body, "messages": [{"role": "user", "content": "x"}]})
        else:
            req = parse_completion({**body, "prompt": [1, 2]})
    except ProtocolError as e:
        assert e.status in (400, 404) and e.message
        return
    try:
        sp = req.sampling_params(req.max_tokens or 16)  # what the server hands the engine
    except ValueError:
        return
    check_sampling_params(sp)
