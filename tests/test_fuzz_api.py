"""Fuzzing the public API with random values of random types (hypothesis).

Every call either succeeds with correct results or raises ValueError; no other exception escapes. Only bad input
may raise, at submission (add_request, abort_request, a malformed generate call before anything is queued):
`step()` never raises, so an error from inside a step fails the test (a kernel's INVALID_ARGUMENT, for one,
reaches Python as a ValueError).
After each case the page pool is whole again, nothing is left in the engine, and a good greedy request, served
alongside whatever the case left running, still gets exactly the full-forward tokens.

CI runs a few hundred cases; a long hunt runs many more with the same tests:
  CBJAX_FUZZ_EXAMPLES=20000 JAX_PLATFORMS=cpu python -m pytest -q tests/test_fuzz_api.py
"""

import math
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cbjax import LLM, LLMEngine, SamplingParams
from cbjax.config.validation import is_integer
from cbjax.engine_config import EngineConfig
from cbjax.model import get_model_config, init_model
from tests.helpers import drain, greedy_reference

EXAMPLES = int(os.environ.get("CBJAX_FUZZ_EXAMPLES", "0")) or None
FUZZ = settings(
    max_examples=EXAMPLES or 150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    derandomize=EXAMPLES is None,  # CI: the same cases every run; a long hunt explores
)
VOCAB = 512  # test-tiny
ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=32, page_size=8, num_pages=24, max_model_len=64)
GOOD_PROMPT, GOOD_TOKENS = [7, 8, 9, 10], 6

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


@pytest.fixture(scope="module")
def model():
    return init_model(get_model_config("test-tiny"), seed=0)


@pytest.fixture(scope="module")
def engine(model):
    return LLMEngine(model, warmup="full", **ENGINE)


@pytest.fixture(scope="module")
def good_tokens(model):
    return greedy_reference(model, [GOOD_PROMPT], [GOOD_TOKENS], width=32)[0]


GREEDY_GOOD = SamplingParams(max_tokens=GOOD_TOKENS, temperature=0.0, ignore_eos=True)
request_ids = st.one_of(st.sampled_from(["a", "b", "c", "good"]), junk)
prompts = st.one_of(
    st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=40),
    st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12),
    st.builds(lambda xs: np.array(xs, dtype=np.int32), st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8)),
    junk,
)
params = st.one_of(sampling_kwargs.map(lambda kw: ("params", kw)), junk.map(lambda j: ("junk", j)), st.none())
extras = st.fixed_dictionaries(
    {},
    optional={
        "priority": maybe(st.integers(-3, 3)),
        "tenant": maybe(st.sampled_from(["t1", "t2"])),
        "deadline": maybe(st.floats(0, 1e6)),
        "arrival_time": maybe(st.none()),
    },
)
operations = st.lists(
    st.one_of(
        st.tuples(st.just("add"), request_ids, prompts, params, extras),
        st.tuples(st.just("abort"), request_ids),
        st.tuples(st.just("step")),
    ),
    max_size=8,
)


def make_params(spec):
    """SamplingParams from a drawn spec, or the junk itself to pass as params. ValueError if it cannot be built."""
    if spec is None:
        return None
    kind, value = spec
    return SamplingParams(**value) if kind == "params" else value


@FUZZ
@given(operations)
def test_engine_api_raises_only_value_errors_and_keeps_serving(engine, good_tokens, ops):
    accepted: dict[str, int] = {}  # request id -> max_tokens
    for op in ops:
        if op[0] == "step":
            engine.step()  # outside the try: whatever a step raises is a bug, never bad input
            continue
        try:
            if op[0] == "add":
                _, rid, prompt, spec, kw = op
                sp = make_params(spec)
                engine.add_request(rid, prompt, sp, **kw)
                accepted[rid] = (sp or SamplingParams()).max_tokens
            else:
                engine.abort_request(op[1])
        except ValueError:
            pass
    engine.add_request("good-check", GOOD_PROMPT, GREEDY_GOOD)
    done = drain(engine)
    assert done["good-check"].outputs[0].token_ids == good_tokens
    for rid, max_tokens in accepted.items():
        if rid in done:  # (an id reused after its request finished within the ops reports the last one)
            out = done[rid].outputs[0]
            assert out.finish_reason in ("length", "stop", "abort") and len(out.token_ids) <= max_tokens
    assert not engine.requests and not engine.has_unfinished_requests()
    pool = engine.scheduler.pool
    assert pool.num_free == pool.num_pages


generate_prompts = st.lists(st.one_of(prompts, st.text(max_size=4)), max_size=5)
generate_params = st.one_of(
    st.none(), params, st.lists(params, min_size=0, max_size=5), junk.map(lambda j: ("junk", j))
)


@FUZZ
@given(generate_prompts, generate_params, st.one_of(st.booleans(), junk))
def test_generate_serves_every_good_prompt_and_reports_the_bad_ones(engine, good_tokens, prompts, spec, tqdm):
    llm = LLM.from_engine(engine)
    try:
        if isinstance(spec, list):
            sp = [make_params(s) for s in spec]
        else:
            sp = make_params(spec)
    except ValueError:
        return  # SamplingParams refused its own arguments (tested above)
    try:
        outs = llm.generate([*prompts, GOOD_PROMPT], sp if not isinstance(sp, list) else [*sp, GREEDY_GOOD], tqdm)
    except ValueError:
        # A malformed call, refused before the first prompt was submitted; a ValueError after that came out of a
        # step (generate reports a refused prompt in its output, it does not raise).
        assert llm.num_submitted == 0
        assert not engine.requests and not engine.has_unfinished_requests()
        return
    assert len(outs) == len(prompts) + 1
    for out in outs:
        reason = out.outputs[0].finish_reason
        assert out.finished and reason in ("length", "stop", "abort")
        assert (out.error is not None) == (reason == "abort")  # generate aborts nothing itself: refused prompts only
    if isinstance(sp, list):
        assert outs[-1].outputs[0].token_ids == good_tokens
    assert not engine.requests and not engine.has_unfinished_requests()
    assert engine.scheduler.pool.num_free == engine.scheduler.pool.num_pages


# ---- structured output: random specs compiled for tinypy's tokenizer (cbjax/structured/) ----
LEAF_SCHEMAS = [
    {"type": "string"}, {"type": "integer", "minimum": 3}, {"type": "number"}, {"type": "boolean"}, {"type": "null"},
    {}, {"type": "bogus"}, {"enum": [1, "a", None]}, {"const": "x"}, {"type": "string", "maxLength": 2},
    {"type": "string", "pattern": "^a+$"}, {"type": "string", "format": "email"},
]  # fmt: skip


def schema_text(schema) -> str:
    import json

    return json.dumps(schema)


schemas = st.recursive(
    st.sampled_from(LEAF_SCHEMAS),
    lambda inner: st.one_of(
        st.dictionaries(st.text(max_size=3), inner, max_size=3).map(lambda p: {"type": "object", "properties": p}),
        inner.map(lambda i: {"type": "array", "items": i, "maxItems": 3}),
        st.lists(inner, min_size=1, max_size=3).map(lambda xs: {"anyOf": xs}),
    ),
    max_leaves=6,
)
REGEX_PIECES = ["a", "b+", "[0-9]", "(a|bc)", ".", r"\d{1,2}", "x?", "[^a]", " ", "\n"]
BROKEN_REGEX_PIECES = ["(", "]", "{2}", "*", "\\", "a{3,1}"]
regex_texts = st.one_of(
    st.lists(st.sampled_from(REGEX_PIECES), max_size=5).map("".join),
    st.lists(st.sampled_from(REGEX_PIECES + BROKEN_REGEX_PIECES), max_size=4).map("".join),
    st.text(max_size=8),
)
LARK_ITEMS = ['"a"', '"bc"', "/[0-9]+/", "x", "|", "(", ")", "*", "?", '"\\n"', "%ignore", ""]
lark_texts = st.one_of(
    st.lists(st.sampled_from(LARK_ITEMS), max_size=5).map(lambda body: "start: " + " ".join(body) + '\nx: "y"'),
    st.text(max_size=16),
)
structured_specs = st.one_of(
    st.tuples(st.just("json"), st.one_of(schemas, schemas.map(schema_text), junk)),
    st.tuples(st.just("regex"), maybe(regex_texts)),
    st.tuples(st.just("choice"), maybe(st.lists(st.text(max_size=5), max_size=3))),
    st.tuples(st.just("grammar"), maybe(lark_texts)),
    st.tuples(st.just("json_object"), maybe(st.just(True))),
)


@pytest.fixture(scope="module")
def structured_compiler():
    from cbjax.model.registry import packaged_model_path
    from cbjax.model.tokenizer import Tokenizer
    from cbjax.structured.compiler import GrammarCompiler

    tok = Tokenizer.from_dir(packaged_model_path("tinypy"))
    return GrammarCompiler(tok, tok.vocab_size + 40, [0])  # 40 ids past the tokenizer's: never allowed


@FUZZ
@given(structured_specs, st.lists(st.integers(0, 2**31), max_size=10), st.integers(0, 12))
def test_structured_spec_compiles_or_raises_value_error_and_masks_hold(structured_compiler, spec, picks, back):
    """A random spec is a ValueError or a constraint whose masks never allow an id past the tokenizer's, that
    takes every token its mask allows, refuses (unchanged) a token it does not, and rolls back to earlier masks."""
    from cbjax.core.structured_outputs import StructuredOutputs
    from tests.structured.reference import allowed_tokens

    kind, value = spec
    try:
        c = structured_compiler.constraint(StructuredOutputs(**{kind: value}))
    except ValueError:
        return
    V = structured_compiler.vocab_size
    masks = []
    for pick in picks:
        mask = allowed_tokens(c, V)
        assert not mask[V - 40 :].any()
        masks.append(mask)
        if not mask.any():
            break
        refused = np.flatnonzero(~mask)
        if len(refused):
            with pytest.raises(ValueError, match="structured output"):
                c.accept([int(refused[pick % len(refused)])])
            assert (allowed_tokens(c, V) == mask).all()
        ok = np.flatnonzero(mask)
        c.accept([int(ok[pick % len(ok)])])
    back = min(back, c.num_accepted)
    c.rollback(back)
    if back and c.num_accepted < len(masks):
        assert (allowed_tokens(c, V) == masks[c.num_accepted]).all()


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


extras_kwargs = st.fixed_dictionaries(
    {"max_tokens": st.integers(1, 6), "temperature": st.sampled_from([0.0, 0.8])},
    optional={
        "logprobs": maybe(st.integers(-1, 30)),
        "prompt_logprobs": maybe(st.integers(-1, 30)),
        "presence_penalty": maybe(st.floats(-3, 3)),
        "frequency_penalty": maybe(st.floats(-3, 3)),
        "repetition_penalty": maybe(st.floats(-1, 3)),
        "min_tokens": maybe(st.integers(-1, 8)),
        "logit_bias": maybe(st.dictionaries(st.integers(-2, VOCAB + 2), st.floats(-200, 200), max_size=3)),
        "logits_processors": maybe(
            st.lists(st.sampled_from([lambda out: {1: -math.inf}, lambda out: {VOCAB: 1.0}, lambda out: 1 / 0]))
        ),
    },
)


@FUZZ
@given(st.lists(extras_kwargs, max_size=4))
def test_sampling_extras_are_served_or_refused_with_value_error(engine, good_tokens, kwargs_list):
    """Requests with the sampling extras (cbjax/runner/extras_runner.py) next to a plain one: bad values are refused
    with a ValueError at add_request (a failing logits processor aborts its request), the plain one stays exact."""
    accepted = {}
    for i, kw in enumerate(kwargs_list):
        try:
            engine.add_request(f"x{i}", [5, 6, 7, 8], SamplingParams(**kw))
            accepted[f"x{i}"] = kw
        except ValueError:
            pass
    engine.add_request("good-check", GOOD_PROMPT, GREEDY_GOOD)
    done = drain(engine)
    assert done["good-check"].outputs[0].token_ids == good_tokens
    for rid, kw in accepted.items():
        out = done[rid].outputs[0]
        assert out.finish_reason in ("length", "stop", "abort") and len(out.token_ids) <= kw["max_tokens"]
        if kw.get("logprobs") is not None and out.finish_reason != "abort":
            assert len(out.logprobs) == len(out.token_ids)
    assert not engine.requests and not engine.has_unfinished_requests()


group_kwargs = st.fixed_dictionaries(
    {"max_tokens": st.integers(1, 8)},
    optional={
        "n": maybe(st.integers(-1, 6)),
        "best_of": maybe(st.one_of(st.none(), st.integers(-1, 7))),
        "temperature": maybe(st.sampled_from([0.0, 0.7, 1.0])),
        "seed": maybe(st.integers(0, 5)),
        "ignore_eos": st.booleans(),
    },
)


@FUZZ
@given(st.lists(st.tuples(group_kwargs, st.integers(1, 30), st.booleans()), max_size=4))
def test_groups_are_served_or_refused_with_value_error(engine, good_tokens, specs):
    """Requests with n / best_of (core/sequence_group.py), some aborted after a step, next to a plain one: bad
    values (n or best_of beyond the slots, best_of < n, best_of > n when greedy) are refused with a ValueError at
    add_request; an accepted group reports n completions, indexed 0..n-1; the plain one stays exact; no page leaks."""
    accepted = {}
    for i, (kw, prompt_len, abort) in enumerate(specs):
        try:
            engine.add_request(f"g{i}", list(range(3, 3 + prompt_len)), SamplingParams(**kw))
            accepted[f"g{i}"] = (kw, abort)
        except ValueError:
            pass
    engine.add_request("good-check", GOOD_PROMPT, GREEDY_GOOD)
    engine.step()
    for rid, (_, abort) in accepted.items():
        if abort and rid in engine.requests:
            engine.abort_request(rid)
    done = drain(engine)
    assert done["good-check"].outputs[0].token_ids == good_tokens
    for rid, (kw, _) in accepted.items():
        outs = done[rid].outputs
        assert [c.index for c in outs] == list(range(kw.get("n", 1)))
        assert all(
            c.finish_reason in ("length", "stop", "abort") and len(c.token_ids) <= kw["max_tokens"] for c in outs
        )
    assert not engine.requests and not engine.has_unfinished_requests()
    pool = engine.scheduler.pool
    assert pool.num_free == pool.num_pages
