"""The server through the official openai client and raw HTTP: completions and chat, streamed and not, greedy
tokens equal to LLM.generate, errors in OpenAI's shape, a disconnect frees its pages, metrics, health, models."""

import asyncio

import httpx
import openai
import pytest

from cbjax import LLM, SamplingParams
from tests.serve.helpers import ENGINE, metric, serve_tinypy, sse_events, wait_for

PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:\n"]


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
    """LLM.generate on an engine of the same options: the tokens the server must reproduce."""
    return LLM("tinypy", **ENGINE)


def test_greedy_completions_equal_llm_generate(server, reference):
    async def one(c, prompt):
        r = await c.completions.create(
            model="tinypy", prompt=prompt, max_tokens=20, temperature=0, extra_body={"return_token_ids": True}
        )
        return r.choices[0]

    async def all_at_once():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as c:
            return await asyncio.gather(*(one(c, p) for p in PROMPTS))

    got = asyncio.run(all_at_once())  # concurrent: they share the engine's batches
    want = reference.generate(PROMPTS, SamplingParams(max_tokens=20, temperature=0.0))
    for g, w in zip(got, want):
        assert g.token_ids == w.outputs[0].token_ids
        assert g.text == w.outputs[0].text and g.finish_reason == w.outputs[0].finish_reason


def test_streamed_completion_equals_the_full_one_with_usage(client):
    kw = dict(model="tinypy", prompt=PROMPTS[0], max_tokens=12, temperature=0.8, seed=7)
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    text_chunks = [c for c in chunks if c.choices]
    assert len(text_chunks) == 12  # one chunk per token, the last one carrying the finish reason
    assert "".join(c.choices[0].text for c in text_chunks) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in text_chunks][-2:] == [None, "length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens and full.usage.completion_tokens == 12


def test_chat_uses_the_plain_template(client, reference):
    messages = [{"role": "user", "content": "write a function"}]
    r = client.chat.completions.create(model="tinypy", messages=messages, max_tokens=10, temperature=0)
    want = reference.generate(["user: write a function\nassistant:"], SamplingParams(max_tokens=10, temperature=0))
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == want[0].outputs[0].text
    stream = client.chat.completions.create(
        model="tinypy", messages=messages, max_tokens=10, temperature=0, stream=True
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == r.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_stop_strings_cut_the_text_and_abort_the_request(server, client):
    full = client.completions.create(model="tinypy", prompt=PROMPTS[0], max_tokens=40, temperature=0).choices[0].text
    stop = full.strip()[:3]  # occurs in the greedy text, after its first characters
    cut = full[: full.find(stop)]
    r = client.completions.create(model="tinypy", prompt=PROMPTS[0], max_tokens=40, temperature=0, stop=[stop])
    assert r.choices[0].text == cut and r.choices[0].finish_reason == "stop" and r.usage.completion_tokens < 40
    streamed = client.completions.create(
        model="tinypy", prompt=PROMPTS[0], max_tokens=40, temperature=0, stop=stop, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == cut
    wait_for(lambda: metric(server.url, "cbjax_kv_pages_used") == 0, what="pages of the stopped requests")


def test_models_health_and_metrics(server, client):
    assert [m.id for m in client.models.list().data] == ["tinypy"]
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    text = httpx.get(server.url + "/metrics").text
    for name in (
        "cbjax_num_requests_running",
        "cbjax_num_requests_waiting",
        "cbjax_kv_pages_used",
        "cbjax_num_preemptions",
        "cbjax_time_to_first_token_seconds_bucket",
        "cbjax_inter_token_latency_seconds_bucket",
        "cbjax_e2e_request_latency_seconds_bucket",
        "cbjax_spec_draft_tokens",
        "cbjax_spec_accepted_tokens",
    ):
        assert name in text, name
    assert metric(server.url, "cbjax_kv_pages_total") == ENGINE["num_pages"]
    assert metric(server.url, "cbjax_time_to_first_token_seconds_count") >= 1


@pytest.mark.parametrize(
    ("body", "status", "param", "words"),
    [
        (b'{"prompt": "x", ', 400, None, "not valid JSON"),
        (b'{"prompt": "x", "max_tokens": 4, "colour": "red"}', 400, "colour", "unknown field"),
        (b'{"prompt": "x", "max_tokens": -1}', 400, None, "max_tokens must be an integer >= 1"),
        (b'{"prompt": [' + b"5, " * 299 + b'5], "max_tokens": 4}', 400, None, "longer than max_model_len=256"),
        (b'{"prompt": [5, 99999], "max_tokens": 4}', 400, None, "outside the vocabulary"),
        (b'{"prompt": "x", "temperature": -1}', 400, None, "temperature must be a finite number >= 0"),
        (b'{"model": "gpt-4", "prompt": "x"}', 404, "model", "does not exist"),
    ],
)
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server, body, status, param, words):
    reason = "unknown_model" if status == 404 else "invalid"
    refused = metric(server.url, "cbjax_requests_rejected_total", reason=reason)
    r = httpx.post(server.url + "/v1/completions", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == status, r.text
    assert metric(server.url, "cbjax_requests_rejected_total", reason=reason) == refused + 1
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param and words in err["message"]
    assert err["type"] == "invalid_request_error"
    if status == 404:
        assert err["code"] == "model_not_found"
    ok = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2, "temperature": 0})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def test_a_bad_request_in_a_stream_is_a_400_before_any_chunk(server):
    r = httpx.post(server.url + "/v1/completions", json={"prompt": [5] * 300, "stream": True})
    assert r.status_code == 400 and "max_model_len" in r.json()["error"]["message"]


def test_the_vllm_bench_request_shape_streams(server):
    body = {
        "model": "tinypy",
        "prompt": "def f(x):",
        "repetition_penalty": 1.0,
        "max_tokens": 8,
        "logprobs": None,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers={"x-request-id": "b-0"}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 8
    assert sum(1 for e in events[:-2] if e["choices"]) == 8


def test_a_client_that_disconnects_mid_stream_is_aborted_and_its_pages_freed(server):
    aborted = metric(server.url, "cbjax_requests_finished_total", finish_reason="abort")
    body = {"prompt": "def f(x):", "max_tokens": 240, "ignore_eos": True, "stream": True, "temperature": 0}
    with httpx.stream("POST", server.url + "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        got = 0
        for line in lines:
            got += line.startswith("data: ")
            if got == 3:
                break
        # Streaming, so it holds pages; then the client goes away with 237 tokens to go.
        assert metric(server.url, "cbjax_kv_pages_used") > 0
    wait_for(lambda: metric(server.url, "cbjax_kv_pages_used") == 0, what="the pages back in the pool")
    assert metric(server.url, "cbjax_requests_finished_total", finish_reason="abort") == aborted + 1
    assert metric(server.url, "cbjax_num_requests_running") == 0
    assert server.engine.scheduler.pool.num_used == 0 and not server.loop.engine.requests
