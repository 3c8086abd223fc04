"""`python -m cbjax.serve` as a process: engine flags reach the engine, priorities cross the network to the
`priority` policy, and SIGINT shuts it down cleanly."""

import os
import signal
import subprocess
import sys
import threading
import time

import httpx

from cbjax.serve.server import free_port
from tests.helpers import ROOT
from tests.serve.helpers import wait_for


def test_the_command_line_server_with_the_priority_policy():
    port = free_port()
    cmd = [
        sys.executable, "-m", "cbjax.serve", "--model=tinypy", f"--port={port}", "--policy=priority",
        '--policy_options={"aging_s": null}', "--max_num_seqs=1", "--max_num_batched_tokens=64", "--num_pages=64",
        "--warmup=none", "--log_level=info",
    ]  # fmt: skip
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:

        def up():
            assert proc.poll() is None, proc.stdout.read()
            try:
                return httpx.get(url + "/health").status_code == 200
            except httpx.ConnectError:
                return False

        wait_for(up, timeout=60, what="the server to listen")
        assert 'cbjax_kv_pages_total{model_name="tinypy"} 64.0' in httpx.get(url + "/metrics").text
        # One slot: a long request runs; then a low-priority and a high-priority one wait for it. The priority
        # policy serves the high one first (fcfs would serve them in arrival order).
        first = threading.Event()

        def long():
            body = {"prompt": "def f(x):", "max_tokens": 240, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        first.set()

        done = []

        def short(name, **kw):
            r = httpx.post(url + "/v1/completions", timeout=60, **kw)
            assert r.status_code == 200, r.text
            done.append(name)

        threads = [threading.Thread(target=long)]
        threads[0].start()
        assert first.wait(30)
        # Long enough to be running still when the high one arrives, if A is done already: then the high one
        # preempts it (the priority policy preempts for a slot; fcfs never does).
        low = {"json": {"prompt": "x", "priority": 5, "max_tokens": 100, "ignore_eos": True}}
        threads.append(threading.Thread(target=short, args=("low",), kwargs=low))
        threads[-1].start()
        time.sleep(0.05)
        high = {"json": {"prompt": "x", "max_tokens": 4}, "headers": {"X-Priority": "-1"}}
        threads.append(threading.Thread(target=short, args=("high",), kwargs=high))
        threads[-1].start()
        for t in threads:
            t.join(60)
        assert done == ["high", "low"]
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    assert "shutdown: 0 request(s) drained [], 0 aborted []" in out
