"""Every sampling option of issue 40 through the official openai client, one test per option: the server maps it to
the SamplingParams LLM.generate would get (same tokens, greedy), returns it in OpenAI's shape (n choices, logprobs,
JSON under response_format), and answers a bad value with a 400 naming the problem."""

import json

import openai
import pytest

from cbjax import LLM, SamplingParams
from cbjax.core.structured_outputs import StructuredOutputs
from tests.serve.helpers import ENGINE, serve_tinypy

PROMPT = "import os\n"  # tinypy's greedy continuation repeats itself: penalties and bad words change it


@pytest.fixture(scope="module")
def server():
    s = serve_tinypy()
    yield s
    s.shutdown()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def reference():
    return LLM("tinypy", **ENGINE)


def _ids(client, **kw):
    """The greedy completion's choice 0, with its token ids."""
    body = dict(model="tinypy", prompt=PROMPT, max_tokens=16, temperature=0)
    extra = kw.pop("extra_body", {})
    r = client.completions.create(**(body | kw), extra_body={"return_token_ids": True} | extra)
    return r.choices[0]


def _want(reference, **kw):
    return reference.generate(PROMPT, SamplingParams(max_tokens=16, temperature=0.0, **kw))[0].outputs[0]


def test_seed_makes_a_sampled_completion_reproducible(client, reference):
    a = _ids(client, temperature=1.0, seed=3)
    assert a.token_ids == _ids(client, temperature=1.0, seed=3).token_ids
    want = reference.generate(PROMPT, SamplingParams(max_tokens=16, temperature=1.0, seed=3))[0].outputs[0]
    assert a.token_ids == want.token_ids


@pytest.mark.parametrize("name", ["presence_penalty", "frequency_penalty"])
def test_presence_and_frequency_penalties(client, reference, name):
    got = _ids(client, **{name: 1.5})
    want = _want(reference, **{name: 1.5})
    assert got.token_ids == want.token_ids and got.text == want.text
    assert got.token_ids != _want(reference).token_ids  # the penalty changed the greedy output


def test_repetition_penalty(client, reference):
    got = _ids(client, extra_body={"repetition_penalty": 1.5})
    want = _want(reference, repetition_penalty=1.5)
    assert got.token_ids == want.token_ids and got.token_ids != _want(reference).token_ids


def test_min_tokens_holds_off_a_stop_token(client):
    first = _want_first_token(client)
    stopped = _ids(client, extra_body={"stop_token_ids": [first]})
    assert stopped.token_ids == [first] and stopped.finish_reason == "stop"
    held = _ids(client, extra_body={"stop_token_ids": [first], "min_tokens": 5})
    assert len(held.token_ids) >= 5 and first not in held.token_ids[:5]


def _want_first_token(client) -> int:
    return _ids(client, max_tokens=1).token_ids[0]


def test_logit_bias_forces_a_token(client):
    tok = 42
    got = _ids(client, logit_bias={str(tok): 100})
    assert got.token_ids == [tok] * 16


def test_bad_words_are_never_completed(client, reference):
    plain = _want(reference)
    got = _ids(client, extra_body={"bad_words": ["sys"]})
    want = _want(reference, bad_words=("sys",))
    assert "sys" in plain.text and got.token_ids == want.token_ids and "sys" not in got.text


def test_stop_strings_and_include_stop_str_in_output(client):
    full = _ids(client, max_tokens=24).text
    stop = "sys"
    assert stop in full
    cut = _ids(client, max_tokens=24, stop=[stop])
    assert cut.text == full[: full.find(stop)] and cut.finish_reason == "stop"
    kept = _ids(client, max_tokens=24, stop=[stop], extra_body={"include_stop_str_in_output": True})
    assert kept.text == full[: full.find(stop) + len(stop)] and kept.token_ids == cut.token_ids


def test_completion_logprobs_in_openai_shape(client, reference):
    r = client.completions.create(model="tinypy", prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    want = reference.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0.0, logprobs=3))[0].outputs[0]
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 8
    for t, chosen, top, entry in zip(want.token_ids, lp.token_logprobs, lp.top_logprobs, want.logprobs):
        assert chosen == pytest.approx(entry[t].logprob, abs=1e-4) and chosen <= 0
        assert 3 <= len(top) <= 4 and max(top.values()) == pytest.approx(chosen, abs=1e-4)  # greedy: the best
    assert "".join(lp.tokens) == r.choices[0].text and lp.text_offset[0] == 0
    streamed = client.completions.create(
        model="tinypy", prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3, stream=True
    )
    tokens = [t for c in streamed for t in c.choices[0].logprobs.tokens]
    assert tokens == lp.tokens


def test_chat_logprobs_and_top_logprobs(client):
    messages = [{"role": "user", "content": "write a function"}]
    r = client.chat.completions.create(
        model="tinypy", messages=messages, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2
    )
    content = r.choices[0].logprobs.content
    assert len(content) == 6 and "".join(c.token for c in content) == r.choices[0].message.content
    for c in content:
        assert len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob == pytest.approx(c.logprob, abs=1e-4)
        assert c.bytes == list(c.token.encode())
    plain = client.chat.completions.create(model="tinypy", messages=messages, max_tokens=6, temperature=0)
    assert plain.choices[0].logprobs is None
    streamed = client.chat.completions.create(
        model="tinypy", messages=messages, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2, stream=True
    )
    got = [(x.token, x.logprob) for c in streamed for x in c.choices[0].logprobs.content]
    assert got == [(x.token, x.logprob) for x in content]


def test_response_format_json_schema(client):
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    rf = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    r = client.chat.completions.create(
        model="tinypy",
        messages=[{"role": "user", "content": "answer in JSON"}],
        max_tokens=48,
        temperature=0,
        response_format=rf,
    )
    value = json.loads(r.choices[0].message.content)
    assert set(value) == {"ok"} and isinstance(value["ok"], bool)


def test_response_format_json_object(client, reference):
    # (the client's completions.create has no response_format argument: vLLM's extension, sent in the body)
    r = _ids(client, max_tokens=48, extra_body={"response_format": {"type": "json_object"}})
    want = reference.generate(
        PROMPT, SamplingParams(max_tokens=48, temperature=0.0, structured=StructuredOutputs(json_object=True))
    )[0].outputs[0]
    # A code model writes long strings: the 48 tokens may end inside one, so the text is checked as JSON's start.
    assert r.token_ids == want.token_ids and r.text.lstrip().startswith("{")
    if r.finish_reason == "stop":
        assert isinstance(json.loads(r.text), dict)


def test_n_returns_n_choices_streamed_interleaved(client):
    kw = dict(model="tinypy", prompt=PROMPT, max_tokens=6, temperature=1.0, seed=5, n=3)
    r = client.completions.create(**kw, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1, 2] and r.usage.completion_tokens == 18
    assert len({c.text for c in r.choices}) > 1  # sampled: not three copies of one text
    chunks = list(client.completions.create(**kw, stream=True, extra_body={"ignore_eos": True}))
    texts = {i: "" for i in range(3)}
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.text
    assert {i for c in chunks for i in (ch.index for ch in c.choices)} == {0, 1, 2}
    assert all(texts[i] for i in texts)


def test_best_of_returns_the_best_n(client):
    r = client.completions.create(model="tinypy", prompt=PROMPT, max_tokens=6, temperature=1.0, seed=5, n=1, best_of=3)
    assert [c.index for c in r.choices] == [0] and r.choices[0].text
    r = client.completions.create(
        model="tinypy", prompt=PROMPT, max_tokens=6, temperature=1.0, seed=5, n=2, best_of=4, logprobs=0
    )
    assert [c.index for c in r.choices] == [0, 1]
    # the best by cumulative log-probability, best first (vLLM): the summed token logprobs do not increase
    sums = [sum(c.logprobs.token_logprobs) for c in r.choices]
    assert sums[0] >= sums[1]


@pytest.mark.parametrize(
    ("kw", "words"),
    [
        (dict(presence_penalty=5), "presence_penalty"),
        (dict(frequency_penalty=-3), "frequency_penalty"),
        (dict(extra_body={"repetition_penalty": 0}), "repetition_penalty"),
        (dict(n=0), "n must be"),
        (dict(logprobs=-1), "logprobs"),
        (dict(logprobs=10_000), "max_logprobs"),
        (dict(logit_bias={"99999": 1}), "outside the vocabulary"),
        (dict(logit_bias={"x": 1}), "token ids"),
        (dict(extra_body={"min_tokens": 99}), "min_tokens"),
        (dict(extra_body={"bad_words": [" "]}), "whitespace"),
        (dict(extra_body={"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}), "schema"),
        (dict(extra_body={"response_format": {"type": "yaml"}}), "response_format"),
        (dict(best_of=2, n=3), "best_of"),
        (dict(seed=-1), "seed"),
        (dict(stop=[""]), "stop"),
    ],
)
def test_bad_option_values_are_400s_with_the_reason(client, kw, words):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tinypy", prompt=PROMPT, max_tokens=4, **kw)
    assert words in e.value.message and e.value.status_code == 400
    assert _ids(client, max_tokens=2).token_ids  # and the server keeps serving
