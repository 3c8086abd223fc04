"""experiments/accelerator_check.py: the small size runs every section on CPU and passes (with two fake devices, so
tensor parallelism runs too); a section that fails, raises, crashes its process or hangs is recorded as such, the
others still run, and the exit status is 1; the full plan a device runs is checked for consistency here."""

import json
import os
import subprocess
import sys

import pytest

from experiments import accelerator_check as ac
from experiments import accelerator_plans as plans
from tests.helpers import ROOT


def test_small_check_runs_every_section_and_passes(tmp_path):
    out = tmp_path / "check.json"
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
        "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.accelerator_check", f"--output={out}"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["size"] == "small"  # the CPU default
    machine = report["machine"]
    assert machine["backend"] == "cpu" and machine["device"]["count"] == 2
    assert machine["versions"]["jax"] and machine["start_time"] and "commit" in machine["git"]
    sections = report["sections"]
    assert list(sections) == list(ac.SECTIONS)
    for name, section in sections.items():
        assert section["status"] == "pass", (name, section)
        assert section["seconds"] > 0 and section["headline"], name
        assert name in proc.stdout  # the table
    kernels = sections["kernels"]
    assert kernels["interpret"] and len(kernels["cases"]) == len(plans.small_plan().kernel_cases)
    for case in kernels["cases"]:
        assert case["finite"] and case["zero_rows_zero"] and case["max_abs_err"] <= case["tolerance"], case
    engine = sections["engine"]
    assert engine["longest_prompt"] > engine["options"]["max_num_batched_tokens"]  # chunked prefill
    assert all(c["equal"] for c in engine["comparisons"].values())
    bandwidth = sections["bandwidth"]
    assert bandwidth["smoke_only"] and bandwidth["copy"]["bytes_per_s"] > 0
    assert all(c["bytes_per_s"] > 0 for c in bandwidth["cases"])
    (run,) = sections["throughput"]["runs"].values()
    assert run["output_tok_per_s"] > 0 and run["output_tokens"] > 0 and run["compiles_after_warmup"] == 0
    assert sections["tensor_parallel"]["tensor_parallel_size"] == 2 and sections["tensor_parallel"]["equal"]


def test_a_failing_or_raising_section_makes_the_exit_status_nonzero_and_the_others_still_run(monkeypatch):
    def raises(plan):
        raise RuntimeError("injected kernel failure")

    monkeypatch.setitem(ac.SECTIONS, "kernels", raises)
    monkeypatch.setitem(ac.SECTIONS, "engine", lambda plan: dict(status="fail", headline="tokens differ"))
    report = ac.run_check("small", ac.machine_info(), skip=["throughput"], isolate=False)
    sections = report["sections"]
    assert sections["kernels"]["status"] == "error" and "injected kernel failure" in sections["kernels"]["error"]
    assert sections["engine"]["status"] == "fail"
    assert sections["bandwidth"]["status"] == "pass"  # ran after the two that failed
    assert sections["throughput"]["status"] == "skip"
    assert sections["tensor_parallel"]["status"] == "skip"  # one device here: a skip with its reason
    assert "one device" in sections["tensor_parallel"]["reason"]
    assert ac.exit_status(report) == 1
    for name in ("kernels", "engine"):
        monkeypatch.setitem(ac.SECTIONS, name, lambda plan: dict(status="pass", headline="ok"))
    assert (
        ac.exit_status(ac.run_check("small", report["machine"], skip=["bandwidth", "throughput"], isolate=False)) == 0
    )


def test_a_section_process_that_crashes_or_hangs_is_an_error_and_the_others_still_run(monkeypatch):
    real_command = ac.section_command
    crash = [sys.executable, "-c", "import sys; sys.exit(3)"]
    monkeypatch.setattr(ac, "section_command", lambda name, *a: crash if name == "kernels" else real_command(name, *a))
    skip = ["engine", "bandwidth", "throughput"]
    report = ac.run_check("small", {}, skip=skip, isolate=True, timeout_s=120)
    sections = report["sections"]
    assert sections["kernels"]["status"] == "error" and "exited 3" in sections["kernels"]["error"]
    assert sections["tensor_parallel"]["status"] == "skip"  # its own process ran and reported
    assert ac.exit_status(report) == 1

    hang = [sys.executable, "-c", "import time; time.sleep(60)"]
    monkeypatch.setattr(ac, "section_command", lambda name, *a: hang)
    hung = ac.run_isolated("engine", "small", timeout_s=1)
    assert hung["status"] == "error" and "ran past 1 s" in hung["error"]


def test_the_full_plan_is_consistent_and_covers_every_kernel_variant():
    """The plan a device runs is built (and its cases validated) here, where a mistake costs nothing."""
    plan = plans.full_plan()
    variants = {(c.op, c.kv_int8) for c in plan.kernel_cases}
    assert variants == {("decode", False), ("decode", True), ("ragged", False), ("ragged", True)}
    assert {c.dtype for c in plan.kernel_cases} == {"float32", "bfloat16"}
    for case in plan.kernel_cases + plan.bandwidth_cases:
        assert (case.num_heads, case.num_kv_heads, case.head_dim) == (32, 8, 128)
        assert case.page_size in (16, 32) and max(case.kv_lens) >= 2048
    assert plan.engine_kv_cache_dtypes == ("auto", "int8") and plan.throughput_models == ("llama-tiny", "llama-small")
    bad = dict(num_heads=4, num_kv_heads=2, head_dim=64, page_size=8, dtype="float32", num_tokens=8, num_slots=2)
    with pytest.raises(ValueError, match="q_len"):
        plans.KernelCase("q past its context", "ragged", (3, 4), q_lens=(4, 1), **bad)
    with pytest.raises(ValueError, match="q_len"):
        plans.KernelCase("more tokens than the bucket", "ragged", (8, 4), q_lens=(8, 1), **bad)
