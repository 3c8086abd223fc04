"""Request bodies -> GenerationRequest: what clients send by default is accepted, anything else named in a 400."""

import pytest

from cbjax.serve.protocol import ProtocolError, parse_chat, parse_completion

# What `vllm bench serve --backend openai` posts (vllm/benchmarks/lib/endpoint_request_func.py, vLLM 0.32).
VLLM_BENCH_BODY = {
    "model": "tinypy",
    "prompt": "def f(x):",
    "repetition_penalty": 1.0,
    "max_tokens": 32,
    "logprobs": None,
    "stream": True,
    "stream_options": {"include_usage": True},
    "ignore_eos": True,
}


def test_the_vllm_bench_body_is_accepted():
    r = parse_completion(VLLM_BENCH_BODY)
    assert (r.prompt, r.max_tokens, r.stream, r.include_usage, r.ignore_eos) == ("def f(x):", 32, True, True, True)


def test_openai_defaults_and_extensions():
    r = parse_completion({"prompt": [1, 2, 3], "n": 1, "echo": False, "frequency_penalty": 0, "user": "u", "seed": 3})
    assert r.prompt == [1, 2, 3] and r.max_tokens == 16 and r.seed == 3 and r.temperature == 1.0
    assert parse_completion({"prompt": ["text"]}).prompt == "text"  # a batch of one
    r = parse_completion({"prompt": "x", "stop": "\n", "priority": 2}, headers={"X-Tenant": "a"})
    assert r.stop == ("\n",) and r.priority == 2 and r.tenant == "a"
    assert parse_completion({"prompt": "x"}, headers={"x-priority": "-1"}).priority == -1


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"prompt": "x", "foo": 1}, "foo", "unknown field"),
        ({"prompt": "x", "echo": True}, "echo", "not supported"),
        ({"prompt": "x", "n": True}, "n", "integer"),
        ({"prompt": "x", "logprobs": "5"}, "logprobs", "integer"),
        ({"prompt": "x", "presence_penalty": "high"}, "presence_penalty", "number"),
        ({"prompt": "x", "logit_bias": {"a": 1}}, "logit_bias", "token ids"),
        ({"prompt": "x", "logit_bias": {"5": "a"}}, "logit_bias", "number"),
        ({"prompt": "x", "logit_bias": [5]}, "logit_bias", "object"),
        ({"prompt": "x", "bad_words": ["ok", 3]}, "bad_words", "strings"),
        ({"prompt": "x", "response_format": {"type": "xml"}}, "response_format", "json_schema"),
        ({"prompt": "x", "response_format": {"type": "json_schema"}}, "response_format", "schema"),
        ({"prompt": "x", "best_of": 3, "stream": True}, "best_of", "streamed"),
        ({"prompt": "x", "top_logprobs": 2}, "top_logprobs", "not supported"),
        ({"prompt": "x", "max_tokens": 1.5}, "max_tokens", "integer"),
        ({"prompt": "x", "max_tokens": True}, "max_tokens", "integer"),
        ({"prompt": "x", "temperature": "hot"}, "temperature", "number"),
        ({"prompt": "x", "stop": ["a", 3]}, "stop", "strings"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options", "stream=true"),
        ({"prompt": ["a", "b"]}, "prompt", "batch of 2"),
        ({"prompt": [1, "a"]}, "prompt", "token ids"),
        ({}, "prompt", "required"),
    ],
)
def test_bad_completion_bodies_name_the_field(body, param, words):
    with pytest.raises(ProtocolError) as e:
        parse_completion(body)
    assert e.value.status == 400 and e.value.param == param and words in e.value.message
    assert set(e.value.body()["error"]) == {"message", "type", "param", "code"}


def test_every_sampling_option_is_parsed_to_its_python_value():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    r = parse_completion(
        {
            "prompt": "x",
            "n": 2,
            "best_of": 3,
            "logprobs": 4,
            "presence_penalty": 0.5,
            "frequency_penalty": -0.5,
            "repetition_penalty": 1.2,
            "min_tokens": 3,
            "logit_bias": {"7": 5, "9": -100.0},
            "bad_words": ["import"],
            "stop": ["\n\n", "def"],
            "include_stop_str_in_output": True,
            "seed": 11,
            "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
        }
    )
    assert (r.n, r.best_of, r.logprobs, r.seed) == (2, 3, 4, 11)
    assert (r.presence_penalty, r.frequency_penalty, r.repetition_penalty, r.min_tokens) == (0.5, -0.5, 1.2, 3)
    assert r.logit_bias == {7: 5.0, 9: -100.0} and r.bad_words == ("import",) and r.stop == ("\n\n", "def")
    assert r.include_stop_str_in_output and r.structured.json == schema
    assert parse_completion({"prompt": "x", "response_format": {"type": "json_object"}}).structured.json_object
    assert parse_completion({"prompt": "x", "response_format": {"type": "text"}}).structured is None
    assert parse_completion({"prompt": "x"}).logprobs is None
    msgs = [{"role": "user", "content": "x"}]
    assert parse_chat({"messages": msgs, "logprobs": True, "top_logprobs": 3})[0].logprobs == 3
    assert parse_chat({"messages": msgs, "logprobs": True})[0].logprobs == 0
    assert parse_chat({"messages": msgs, "logprobs": False})[0].logprobs is None
    for bad, param in (({"top_logprobs": 2}, "top_logprobs"), ({"best_of": 2}, "best_of")):
        with pytest.raises(ProtocolError) as e:
            parse_chat({"messages": msgs, **bad})
        assert e.value.param == param


def test_not_an_object():
    with pytest.raises(ProtocolError, match="JSON object"):
        parse_completion([1, 2])


def test_chat_messages():
    r, msgs = parse_chat(
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "max_completion_tokens": 5}
    )
    assert msgs == [{"role": "user", "content": "hi"}] and r.max_tokens == 5 and r.kind == "chat"
    assert parse_chat({"messages": [{"role": "user", "content": "x"}]})[0].max_tokens is None
    for bad in ({"messages": []}, {"messages": [{"content": "x"}]}, {"messages": [{"role": "user", "content": 3}]}):
        with pytest.raises(ProtocolError):
            parse_chat(bad)
    with pytest.raises(ProtocolError, match="unknown"):
        parse_chat({"messages": [{"role": "user", "content": "x"}], "prompt": "x"})
