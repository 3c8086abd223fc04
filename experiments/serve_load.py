"""Load test of a running cbjax server (python -m cbjax.serve): N concurrent streaming clients, Poisson arrivals.

  python -m cbjax.serve --model tinypy --max_num_seqs 64 --max_waiting_requests 128 --port 8100 &
  python -m experiments.serve_load --base_url http://127.0.0.1:8100 --clients 256 --duration_s 120

Each of `--clients` clients repeats: wait an exponential time (mean `--think_s`; so the arrivals of many clients
together are a Poisson process), then stream one completion (`stream_options.include_usage`, `return_token_ids`)
for one of `--cases` fixed cases (a prompt, max_tokens, temperature and seed). After the run, each case is
requested once more, not streamed: every stream's tokens and text must equal that reference for its case (no token
lost, duplicated or reordered; seeded sampling does not depend on the batch). A 429 is counted, by design; any
other failure is an error. Every `--sample_s` it reads /metrics: the server's RSS, KV pages used, running and
waiting requests. At the end it waits for the server to go idle and checks that no KV page is still in use.
Prints and writes (`--out`) one JSON summary per round.

`--rounds N` runs the whole test N times in a row against the same server; `--doc_data PATH` writes the docs' data
file (cbjax/bench/doc_data.py): one run record per round (server, clients, round, every figure, the machine's load
average before and after), with `--server_command` (how the server was started) recorded beside the command:

  python -m experiments.serve_load --clients 256 --duration_s 60 --rounds 3 --doc_data docs/data/serve_load_DATE.json \
      --server_command "python -m cbjax.serve --model tinypy ..."
"""

import asyncio
import contextlib
import json
import logging
import os
import random
import re
import shlex
import statistics
import sys
import time

import httpx
from absl import app, flags

from cbjax.bench.doc_data import write_doc_data

_URL = flags.DEFINE_string("base_url", "http://127.0.0.1:8100", "the server")
_MODEL = flags.DEFINE_string("model", "tinypy", "the model name the server serves")
_CLIENTS = flags.DEFINE_integer("clients", 256, "concurrent clients")
_DURATION = flags.DEFINE_float("duration_s", 120.0, "how long clients start new requests")
_THINK = flags.DEFINE_float("think_s", 1.0, "mean of each client's exponential wait before each request")
_CASES = flags.DEFINE_integer("cases", 64, "distinct (prompt, max_tokens, temperature, seed) cases")
_MAX_TOKENS = flags.DEFINE_list("max_tokens", ["8", "64"], "range of max_tokens per case")
_SAMPLE = flags.DEFINE_float("sample_s", 5.0, "how often to read /metrics")
_SEED = flags.DEFINE_integer("seed", 0, "the cases and the clients' waits")
_OUT = flags.DEFINE_string("out", None, "write the JSON summary here (a list of them with --rounds > 1)")
_ROUNDS = flags.DEFINE_integer("rounds", 1, "run the whole test this many times in a row, one summary each")
_DOC_DATA = flags.DEFINE_string("doc_data", None, "write the docs' data file here: one run record per round")
_SERVER_COMMAND = flags.DEFINE_string("server_command", "", "how the server was started, kept in the data file")

PROMPTS = [
    "def fibonacci(n):",
    "import os\n",
    "class Stack:\n",
    "def read_file(path):\n    with open(path) as f:",
    "for i in range(10):",
    "# Copyright 2001 Python Software Foundation\n",
    "def __init__(self, name, value=None):",
    "try:\n    import json\nexcept ImportError:",
]


def make_cases(n: int, lo: int, hi: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [
        {
            "prompt": rng.choice(PROMPTS),
            "max_tokens": rng.randint(lo, hi),
            # Half greedy, half sampled with a fixed seed: both must stream exactly their reference.
            "temperature": 0.0 if i % 2 == 0 else 0.8,
            "seed": rng.randrange(2**31),
        }
        for i in range(n)
    ]


async def stream_one(client: httpx.AsyncClient, case: dict) -> dict:
    body = {
        "model": _MODEL.value,
        **case,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }
    t0 = time.perf_counter()
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return {"status": r.status_code, "retry_after": r.headers.get("retry-after")}
        tokens, text, usage, times, done, error = [], [], None, [], False, None
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                done = True
                break
            chunk = json.loads(data)
            if "error" in chunk:
                error = chunk["error"]["message"]
            elif chunk.get("choices"):
                times.append(time.perf_counter() - t0)
                tokens += chunk["choices"][0]["token_ids"]
                text.append(chunk["choices"][0]["text"])
            elif chunk.get("usage"):
                usage = chunk["usage"]
    return {"status": 200, "tokens": tokens, "text": "".join(text), "usage": usage, "done": done, "error": error,
            "ttft": times[0] if times else None, "e2e": time.perf_counter() - t0}  # fmt: skip


async def client_loop(i: int, client, cases, end: float, results: list, rng: random.Random) -> None:
    while True:
        await asyncio.sleep(rng.expovariate(1.0 / _THINK.value))
        if time.monotonic() >= end:
            return
        k = rng.randrange(len(cases))
        try:
            res = await stream_one(client, cases[k])
        except httpx.HTTPError as e:
            res = {"status": None, "exception": repr(e)}
        res["case"] = k
        results.append(res)


def read_metrics(text: str) -> dict:
    want = {
        "process_resident_memory_bytes": "rss_mb",
        "cbjax_kv_pages_used": "pages_used",
        "cbjax_num_requests_running": "running",
        "cbjax_num_requests_waiting": "waiting",
    }
    out = {}
    for line in text.splitlines():
        m = re.fullmatch(r"(\w+)(?:\{.*\})? (\S+)", line)
        if m and m.group(1) in want:
            v = float(m.group(2))
            out[want[m.group(1)]] = round(v / 2**20, 1) if m.group(1).startswith("process") else int(v)
    return out


async def sampler(client, t0: float, samples: list, stop: asyncio.Event) -> None:
    while not stop.is_set():
        try:
            r = await client.get("/metrics")
            samples.append({"t": round(time.monotonic() - t0, 1), **read_metrics(r.text)})
        except httpx.HTTPError:
            pass
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), _SAMPLE.value)


async def run() -> dict:
    lo, hi = (int(x) for x in _MAX_TOKENS.value)
    cases = make_cases(_CASES.value, lo, hi, _SEED.value)
    limits = httpx.Limits(max_connections=_CLIENTS.value + 8, max_keepalive_connections=_CLIENTS.value + 8)
    async with httpx.AsyncClient(base_url=_URL.value, limits=limits, timeout=600) as client:
        before = read_metrics((await client.get("/metrics")).text)
        results, samples, stop = [], [], asyncio.Event()
        t0 = time.monotonic()
        sampling = asyncio.create_task(sampler(client, t0, samples, stop))
        rngs = [random.Random(_SEED.value * 100_003 + i) for i in range(_CLIENTS.value)]
        end = t0 + _DURATION.value
        await asyncio.gather(*(client_loop(i, client, cases, end, results, rngs[i]) for i in range(_CLIENTS.value)))
        wall = time.monotonic() - t0
        # Idle again: no request running or waiting, and every KV page back in the pool.
        for _ in range(100):
            idle = read_metrics((await client.get("/metrics")).text)
            if idle.get("running") == 0 and idle.get("waiting") == 0:
                break
            await asyncio.sleep(0.1)
        stop.set()
        await sampling
        refs = []
        for case in cases:
            r = await client.post("/v1/completions", json={"model": _MODEL.value, **case, "return_token_ids": True})
            r.raise_for_status()
            refs.append(r.json()["choices"][0])
    ok = [r for r in results if r["status"] == 200 and r["done"] and r["error"] is None]
    mismatched = [r for r in ok if r["tokens"] != refs[r["case"]]["token_ids"] or r["text"] != refs[r["case"]]["text"]]
    bad_usage = [r for r in ok if (r["usage"] or {}).get("completion_tokens") != len(r["tokens"])]
    rejected = [r for r in results if r["status"] == 429]
    ok_ids = {id(r) for r in ok}
    errors = [r for r in results if id(r) not in ok_ids and r["status"] != 429]
    ttft = sorted(r["ttft"] for r in ok if r["ttft"] is not None)
    rss = [s["rss_mb"] for s in samples if "rss_mb" in s]
    return {
        "clients": _CLIENTS.value,
        "duration_s": _DURATION.value,
        "think_s": _THINK.value,
        "wall_s": round(wall, 1),
        "requests": len(results),
        "completed": len(ok),
        "rejected_429": len(rejected),
        "retry_after_headers": sorted({r["retry_after"] for r in rejected}),
        "errors": len(errors),
        "error_examples": [{k: v for k, v in r.items() if k != "tokens"} for r in errors[:3]],
        "stream_token_mismatches": len(mismatched),
        "usage_mismatches": len(bad_usage),
        "output_tokens": sum(len(r["tokens"]) for r in ok),
        "output_tok_per_s": round(sum(len(r["tokens"]) for r in ok) / wall, 1),
        "ttft_s_p50": round(statistics.median(ttft), 3) if ttft else None,
        "ttft_s_p99": round(ttft[int(0.99 * (len(ttft) - 1))], 3) if ttft else None,
        "pages_used_before": before.get("pages_used"),
        "pages_used_after": idle.get("pages_used"),
        "running_after": idle.get("running"),
        "rss_mb_first_last_max": [rss[0], rss[-1], max(rss)] if rss else None,
        "rss_mb_before": before.get("rss_mb"),
        **{
            f"peak_{k}": max((s[k] for s in samples if k in s), default=None)
            for k in ("running", "waiting", "pages_used")
        },
        "samples": samples,
    }


def load_average() -> list[float] | None:
    """The 1, 5 and 15 minute load averages (None where the OS has none): how busy the shared machine was."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def doc_record(summary: dict, round_: int, before, after) -> dict:
    """One run of the data file: the labels (server, clients, round) and every figure of the summary."""
    return {"server": "cbjax", "clients": summary["clients"], "round": round_, **summary,
            "load_average_before": before, "load_average_after": after}  # fmt: skip


def main(argv) -> None:
    del argv
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    summaries, records = [], []
    for i in range(_ROUNDS.value):
        before = load_average()
        summary = asyncio.run(run())
        records.append(doc_record(summary, i + 1, before, load_average()))
        summaries.append(summary)
        print(json.dumps(summary, indent=1), flush=True)
    if _OUT.value:
        with open(_OUT.value, "w") as f:
            f.write(json.dumps(summaries[0] if len(summaries) == 1 else summaries, indent=1) + "\n")
    if _DOC_DATA.value:
        write_doc_data(
            _DOC_DATA.value,
            command="python -m experiments.serve_load " + shlex.join(sys.argv[1:]),
            runs=records,
            what=f"{_CLIENTS.value} streaming clients against one cbjax server, {_ROUNDS.value} rounds of "
            f"{_DURATION.value:g} s in a row",
            server_command=_SERVER_COMMAND.value,
        )


if __name__ == "__main__":
    app.run(main)
