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
        ({"prompt": "x", "n": 2}, "n", "not supported"),
        ({"prompt": "x", "n": True}, "n", "not supported"),
        ({"prompt": "x", "logprobs": 1}, "logprobs", "not supported"),
        ({"prompt": "x", "presence_penalty": 0.5}, "presence_penalty", "not supported"),
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
