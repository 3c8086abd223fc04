"""Fuzzing the engine's public API with random values of random types (hypothesis); the options alone are fuzzed in
tests/test_fuzz_options.py, structured-output specs in tests/test_fuzz_structured.py.

Every call either succeeds with correct results or raises ValueError; no other exception escapes. Only bad input
may raise, at submission (add_request, abort_request, a malformed generate call before anything is queued):
`step()` never raises, so an error from inside a step fails the test (a kernel's INVALID_ARGUMENT, for one,
reaches Python as a ValueError).
After each case the page pool is whole again, nothing is left in the engine, and a good greedy request, served
alongside whatever the case left running, still gets exactly the full-forward tokens.

CI runs a few hundred cases; a long hunt runs many more (tests/fuzz_values.py says how).
"""

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from cbjax import LLM, LLMEngine, SamplingParams
from cbjax.model import get_model_config, init_model
from tests.fuzz_values import FUZZ, VOCAB, junk, maybe, sampling_kwargs
from tests.helpers import drain, greedy_reference

ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=32, page_size=8, num_pages=24, max_model_len=64)
GOOD_PROMPT, GOOD_TOKENS = [7, 8, 9, 10], 6


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
