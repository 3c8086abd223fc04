"""The data files of experiments/throughput.py (--doc_data) and experiments/throughput_vs_vllm.py: every process a
run, the command as a reader would type it, and a table the `ab` view can make from them."""

import json
import sys

import pytest

from cbjax.bench.doc_data import read_doc_data
from experiments import throughput, throughput_vs_vllm
from experiments.doc_views import VIEWS


def test_command_line_leaves_out_the_data_file_in_either_spelling():
    argv = ["--workload", "wl.json", "--doc_data", "out.json", "--model", "m", "--doc_data=x.json", "--repeats", "3"]
    assert throughput.command_line(argv) == "python -m experiments.throughput --workload wl.json --model m --repeats 3"


def test_last_json_line_skips_the_logs():
    assert throughput_vs_vllm.last_json_line('INFO starting\n{"a": 1}\nWARNING done\n') == {"a": 1}


def fake(engine: str):
    """A process that prints a result line as the real ones do: cbjax at 200 tok/s, vLLM at 100."""

    def command(*args):
        rate = 200.0 if engine == "cbjax" else 100.0
        line = json.dumps({"method": engine, "output_tokens": 400, "wall_s": 400 / rate, "output_tok_per_s": rate})
        return [sys.executable, "-c", f"print('log line'); print({line!r})"]

    return command


def test_rounds_write_one_run_per_process_and_the_ab_table(tmp_path, monkeypatch):
    wl = tmp_path / "wl64.json"
    wl.write_text(json.dumps([{"prompt_token_ids": [1, 2, 3], "max_new_tokens": 4}] * 2))
    monkeypatch.setattr(throughput_vs_vllm, "cbjax_command", fake("cbjax"))
    monkeypatch.setattr(throughput_vs_vllm, "vllm_command", fake("vllm"))
    out = tmp_path / "data.json"
    args = ["--workloads", str(wl), "--models", "llama-tiny=tiny-llama", "--rounds", "2", "--doc_data", str(out)]
    throughput_vs_vllm.main([*args, "--lock", str(tmp_path / "lock")])
    data = read_doc_data(str(out))
    assert [(r["engine"], r["round"]) for r in data["runs"]] == [("cbjax", 1), ("vllm", 1), ("cbjax", 2), ("vllm", 2)]
    assert {r["workload"] for r in data["runs"]} == {"wl64"}
    assert all(r["result"]["output_tokens"] == 400 and "load_average_before" in r for r in data["runs"])
    assert data["workloads"]["wl64"]["requests"] == 2
    table = VIEWS["ab"](
        data, by=["workload", "model", "dtype"], side="engine", a="cbjax", b="vllm", value="output_throughput"
    )
    assert "| wl64 | llama-tiny | float32 |" in table and "2.00x" in table


def test_also_cbjax_adds_a_cbjax_side_with_its_env_and_flags(tmp_path, monkeypatch):
    """--also_cbjax NAME=VAR=VALUE,--flag=value: one more cbjax process per round, after cbjax and before vLLM,
    with the variable set and the flag appended."""
    wl = tmp_path / "wl64.json"
    wl.write_text(json.dumps([{"prompt_token_ids": [1, 2, 3], "max_new_tokens": 4}] * 2))
    seen = []

    def cbjax_command(*args):
        line = json.dumps({"output_tokens": 400, "wall_s": 2.0, "output_tok_per_s": 200.0})
        code = f"import os, sys; print(os.environ.get('CBJAX_MATMUL'), sys.argv[1:]); print({line!r})"
        return [sys.executable, "-c", code]

    monkeypatch.setattr(throughput_vs_vllm, "cbjax_command", cbjax_command)
    monkeypatch.setattr(throughput_vs_vllm, "vllm_command", fake("vllm"))
    real_run = throughput_vs_vllm.run_process
    monkeypatch.setattr(
        throughput_vs_vllm, "run_process", lambda cmd, env, t: (seen.append((cmd, env)), real_run(cmd, env, t))[1]
    )
    out = tmp_path / "data.json"
    args = ["--workloads", str(wl), "--models", "llama-tiny=tiny-llama", "--rounds", "1", "--doc_data", str(out)]
    throughput_vs_vllm.main([*args, "--also_cbjax", "cbjax-xla=CBJAX_MATMUL=xla,--kv_cache_dtype=bfloat16"])
    data = read_doc_data(str(out))
    assert [r["engine"] for r in data["runs"]] == ["cbjax", "cbjax-xla", "vllm"]
    (plain, _), (also, also_env), _ = seen
    assert also == plain + ["--kv_cache_dtype=bfloat16"] and also_env["CBJAX_MATMUL"] == "xla"
    with pytest.raises(ValueError, match="--also_cbjax takes"):
        throughput_vs_vllm.main([*args, "--also_cbjax", "vllm=A=1"])
