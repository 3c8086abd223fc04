"""A tinypy server on a free port for the server tests, and small HTTP helpers."""

import json
import re
import time

import httpx

from cbjax.engine import LLMEngine
from cbjax.serve.server import ServeHandle, checkpoint_of, start_in_thread

# Small and quick: few slots, a 64-token step budget, 64 pages of 16 tokens (enough for 4 full-length sequences).
ENGINE = dict(max_num_seqs=8, max_num_batched_tokens=64, page_size=16, num_pages=64, warmup="none")


def serve_tinypy(engine_options=None, **server_options) -> ServeHandle:
    engine = LLMEngine("tinypy", **(engine_options or ENGINE))
    return start_in_thread(engine, model_name="tinypy", checkpoint_dir=checkpoint_of("tinypy"), **server_options)


def metric(url: str, name: str, **labels) -> float:
    """One sample of GET /metrics (the model_name label is implied)."""
    text = httpx.get(url + "/metrics").text
    want = {"model_name": "tinypy", **labels}
    for line in text.splitlines():
        m = re.fullmatch(r"(\w+)(?:\{(.*)\})? (\S+)", line)
        if m and m.group(1) == name:
            got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
            if got == want:
                return float(m.group(3))
    return 0.0


def wait_for(predicate, timeout: float = 20.0, what: str = "condition") -> None:
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def sse_events(lines) -> list:
    """The data payloads of an SSE stream: parsed JSON, or the string "[DONE]"."""
    out = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out
