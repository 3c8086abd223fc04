"""experiments/sim_fidelity.py: by default the fidelity study (its report of a saved study here; the study itself
is tests/bench/test_fidelity_study.py's), and its older per-case mode end to end (a subprocess) on one small case:
the real engine twice, the simulator with a profile, and the drift diagnostics. The case is offline fcfs, whose
decisions do not depend on the clock, so the diagnostics have exact answers: every latency scales one for one with
the step time (elasticity 1, throughput -1), and at a real run's own speed the simulator's throughput is that
run's."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _env() -> dict:
    return {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}


def test_it_reports_the_studys_three_targets_and_keeps_the_per_case_protocol_behind_a_flag():
    study = os.path.join(ROOT, "docs", "data", "sim_fidelity_study_2026-12-04.json")
    cmd = [sys.executable, "-m", "experiments.sim_fidelity", f"--report={study}"]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for target in ("Step-level bias within ±5%", "inside the real 95% interval", "- Ranking:"):
        assert target in proc.stdout
    cmd = [sys.executable, "-m", "experiments.sim_fidelity", "--cases=preempt-recompute"]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "--mode=cases" in proc.stderr


def test_the_drift_diagnostics_of_a_clock_free_case(tmp_path):
    env = _env()
    output = tmp_path / "fidelity.json"
    profile = os.path.join(ROOT, "configs", "profiles", "llama-tiny-cpu.json")
    cmd = [sys.executable, "-m", "experiments.sim_fidelity", "--mode=cases", f"--profile={profile}",
           "--cases=preempt-recompute",
           "--real_repeats=2", "--scale=0.05", f"--output={output}"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Speed-matched" in proc.stdout and "Elasticity" in proc.stdout
    case = json.loads(output.read_text())["cases"]["preempt-recompute"]
    assert len(case["real_runs"]) == len(case["run_speeds"]) == len(case["speed_matched"]) == 2
    assert case["elasticity"]["output_throughput"] == pytest.approx(-1.0, abs=0.01)
    for k in ("ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50", "e2e_ms_p50"):
        assert case["elasticity"][k] == pytest.approx(1.0, abs=0.01)
    for run in case["speed_matched"]:
        assert run["output_throughput"] == pytest.approx(0.0, abs=1e-3)
    # The profile's error on the first run's steps is that run's speed, seen from the other side.
    assert case["step_time_error"] == pytest.approx(1 / case["run_speeds"][0] - 1)
