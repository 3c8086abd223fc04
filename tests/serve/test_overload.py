"""Overload and the end of a server's life: 429 with Retry-After beyond the waiting bound, a request timeout, and a
graceful shutdown that drains what finishes in time, aborts the rest and says which."""

import threading
import time

import httpx
import pytest

from tests.serve.helpers import metric, serve_tinypy, sse_events, wait_for

# One slot, so a second request waits; at most one waiting; steps slowed to 10 ms so a long request stays running.
ONE_SLOT = dict(max_num_seqs=1, max_num_batched_tokens=64, page_size=16, num_pages=64, warmup="none")
LONG = {"prompt": "def f(x):", "max_tokens": 200, "ignore_eos": True, "temperature": 0, "stream": True}


def _slow_steps(engine, seconds=0.01):
    step = engine.step_deltas  # (the engine loop's step: outputs read in bulk)

    def slow():
        time.sleep(seconds)
        return step()

    engine.step_deltas = slow


class Stream:
    """A streamed request read on a thread: `.events` fills as chunks arrive."""

    def __init__(self, url, body):
        self.events, self.status = [], None
        self.thread = threading.Thread(target=self._read, args=(url, body), daemon=True)
        self.thread.start()

    def _read(self, url, body):
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            self.status = r.status_code
            for line in r.iter_lines():  # one at a time, as they arrive
                self.events.extend(sse_events([line]))

    def tokens(self) -> int:
        return sum(1 for e in self.events if isinstance(e, dict) and e.get("choices"))


@pytest.fixture(scope="module")
def server():
    s = serve_tinypy(ONE_SLOT, max_waiting=1)
    _slow_steps(s.engine)
    yield s
    s.shutdown()


def test_beyond_the_waiting_bound_a_429_with_retry_after(server):
    running = Stream(server.url, LONG)
    wait_for(lambda: running.tokens() >= 1, what="the first request running")
    waiting = Stream(server.url, {**LONG, "max_tokens": 2})
    wait_for(lambda: metric(server.url, "cbjax_num_requests_waiting") == 1, what="the second request waiting")
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert r.status_code == 429 and r.headers["retry-after"] == "1"
    err = r.json()["error"]
    assert err["type"] == "rate_limit_error" and err["code"] == "rate_limit_exceeded"
    assert "waiting queue" in err["message"]
    running.thread.join(30)
    waiting.thread.join(30)
    # Both accepted requests were served in full.
    assert running.tokens() == 200 and waiting.tokens() == 2 and waiting.events[-1] == "[DONE]"
    assert metric(server.url, "cbjax_requests_rejected_total", reason="queue_full") == 1


def test_a_request_past_its_timeout_is_aborted_with_408(server):
    server.loop.request_timeout_s = 0.3
    try:
        t0 = time.monotonic()
        r = httpx.post(server.url + "/v1/completions", json={**LONG, "stream": False}, timeout=30)
    finally:
        server.loop.request_timeout_s = None
    assert r.status_code == 408 and "timed out after 0.3 s" in r.json()["error"]["message"]
    assert time.monotonic() - t0 < 1.5  # 200 slowed steps take over 2 s
    wait_for(lambda: metric(server.url, "cbjax_kv_pages_used") == 0, what="the pages of the timed-out request")


def test_a_non_streamed_client_that_gives_up_is_aborted(server):
    aborted = metric(server.url, "cbjax_requests_finished_total", finish_reason="abort")
    with pytest.raises(httpx.ReadTimeout):  # 200 slowed steps take over 2 s
        httpx.post(server.url + "/v1/completions", json={**LONG, "stream": False}, timeout=0.5)
    wait_for(lambda: metric(server.url, "cbjax_requests_finished_total", finish_reason="abort") == aborted + 1)
    wait_for(lambda: metric(server.url, "cbjax_kv_pages_used") == 0, what="the pages of the abandoned request")


def test_graceful_shutdown_drains_what_finishes_in_time_and_aborts_the_rest():
    # 20 ms steps: the long request needs 4 s, the short one 0.4 s, the drain window is 2 s.
    s = serve_tinypy({**ONE_SLOT, "max_num_seqs": 2}, shutdown_timeout_s=2.0)
    _slow_steps(s.engine, 0.02)
    long = Stream(s.url, LONG)
    wait_for(lambda: long.tokens() >= 1, what="the long request running")
    short = Stream(s.url, {**LONG, "max_tokens": 20})
    wait_for(lambda: short.tokens() >= 1, what="the short request running")
    s.shutdown()
    long.thread.join(10)
    short.thread.join(10)
    # The short one finished within the drain window; the long one was cut and told why, then [DONE].
    assert short.tokens() == 20 and short.events[-1] == "[DONE]"
    assert long.tokens() < 200 and "shutting down" in long.events[-2]["error"]["message"]
    assert long.events[-1] == "[DONE]"
    assert len(s.loop.drained) == 1 and len(s.loop.aborted_at_shutdown) == 1
    assert s.engine.scheduler.pool.num_used == 0 and not s.loop.alive
    with pytest.raises(httpx.ConnectError):
        httpx.get(s.url + "/health")
