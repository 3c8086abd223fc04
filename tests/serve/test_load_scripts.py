"""The server-measuring scripts: experiments/serve_load.py against a small live server (its rounds and data file),
and the pieces of experiments/vllm_bench_serve.py's comparison that do not need vLLM (the same options and request
stream for both servers, alternating order, the records)."""

import json
import os
import subprocess
import sys
import types

import pytest

from experiments import vllm_bench_serve as vbs
from tests.serve.helpers import serve_tinypy

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def server():
    handle = serve_tinypy()
    yield handle
    handle.shutdown()


SERVER = "python -m cbjax.serve --model tinypy"


def test_serve_load_rounds_write_a_doc_data_file(server, tmp_path):
    path = tmp_path / "load.json"
    argv = [sys.executable, "-m", "experiments.serve_load", "--base_url", server.url, "--clients", "3",
            "--duration_s", "0.5", "--think_s", "0.1", "--cases", "4", "--max_tokens", "2,6", "--sample_s", "0.2",
            "--rounds", "2", "--doc_data", str(path), "--server_command", SERVER]  # fmt: skip
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads(path.read_text())
    assert data["command"].startswith("python -m experiments.serve_load --base_url")
    assert data["server_command"] == SERVER and data["commit"] and data["cpu"]
    assert [r["round"] for r in data["runs"]] == [1, 2]
    for run in data["runs"]:
        assert run["server"] == "cbjax" and run["clients"] == 3 and run["requests"] > 0
        assert run["errors"] == 0 and run["stream_token_mismatches"] == 0 and run["pages_used_after"] == 0
        assert len(run["load_average_before"]) == 3 and run["peak_running"] >= 0 and run["rss_mb_before"] > 0


def _args(**over):
    a = vbs.compare_parser().parse_args([])
    return types.SimpleNamespace(**{**vars(a), **over})


def test_both_servers_get_the_same_options():
    a = _args(max_num_seqs=96, max_num_batched_tokens=256, max_model_len=200)
    cb, vl = vbs.server_command("cbjax", a, 1), vbs.server_command("vllm", a, 2)

    def value(cmd, flag):
        return cmd[cmd.index(flag) + 1]

    assert value(cb, "--max_num_seqs") == value(vl, "--max-num-seqs") == "96"
    assert value(cb, "--max_num_batched_tokens") == value(vl, "--max-num-batched-tokens") == "256"
    assert value(cb, "--max_model_len") == value(vl, "--max-model-len") == "200"
    assert value(cb, "--dtype") == value(vl, "--dtype") == "float32"
    assert "--noenable_prefix_caching" in cb and "--no-enable-prefix-caching" in vl
    assert value(cb, "--warmup") == "full"
    on = _args(prefix_caching=True)
    assert "--enable_prefix_caching" in vbs.server_command("cbjax", on, 1)
    assert "--enable-prefix-caching" in vbs.server_command("vllm", on, 2)


def test_the_request_stream_depends_only_on_the_rate_and_seed():
    a = _args()
    assert vbs.bench_args("U", a, 200, 8.0) == vbs.bench_args("U", a, 200, 8.0)
    args = vbs.bench_args("U", a, 200, 8.0)
    assert args[args.index("--seed") + 1] == "0" and "--ignore-eos" in args
    warm = vbs.bench_args("U", a, 64, 24.0, seed=1)
    assert warm[warm.index("--seed") + 1] == "1"  # the warm-up sends other prompts than the measured runs


def test_rounds_alternate_which_server_goes_first():
    assert [vbs.round_order("cbjax", r) for r in (1, 2, 3)] == [["cbjax", "vllm"], ["vllm", "cbjax"], ["cbjax", "vllm"]]
    assert vbs.round_order("vllm", 1) == ["vllm", "cbjax"]


def test_records_keep_only_scalar_figures():
    result = {"completed": 10, "output_throughput": 500.5, "ttfts": [0.1, 0.2], "generated_texts": ["a"],
              "date": "x", "flag": True}  # fmt: skip
    assert vbs.scalars(result) == {"completed": 10, "output_throughput": 500.5}
