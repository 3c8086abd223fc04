"""experiments/ab_throughput.py end to end (a subprocess): two engines in one process, runs alternating, the same
greedy tokens on both sides, one ratio per repeat."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_blocks_against_single_steps_in_one_process(tmp_path):
    workload = tmp_path / "wl.json"
    requests = [{"prompt_token_ids": list(range(3, 3 + n)), "max_new_tokens": 20} for n in (3, 9, 17)]
    workload.write_text(json.dumps(requests))
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    small = ["--max_num_seqs=4", "--max_num_batched_tokens=32", "--page_size=8", "--num_pages=64", "--max_model_len=64"]
    cmd = [sys.executable, "-m", "experiments.ab_throughput", f"--workload={workload}", "--model=test-tiny", *small]
    cmd += ["--a", json.dumps({"num_scheduler_steps": 1}), "--b", "{}", "--repeats=3"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, lines  # no "other tokens" warning: blocks give single steps' tokens
    result = lines[0]
    assert result["output_tokens"] == 60 and len(result["ratios"]) == 3
    assert result["a"]["options"] == {"num_scheduler_steps": 1} and len(result["b"]["wall_s_runs"]) == 3
    assert result["ratio_b_over_a"] > 0
