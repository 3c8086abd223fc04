"""The policy comparison end to end (a subprocess on configs/compare_tiny.py) and its Ctrl-C path (in process)."""

import datetime
import json
import math
import os
import re
import subprocess
import sys

import pytest

from cbjax.bench import comparison_table as tables
from experiments import compare_policies as cp
from tests.helpers import ROOT
from tests.helpers import parse_config as parse

TINY = os.path.join(ROOT, "configs", "compare_tiny.py")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
FILES = (
    "config.json",
    "manifest.json",
    "summary.json",
    "summary.csv",
    "requests.jsonl",
    "steps.jsonl",
    "throughput.png",
    "latency_cdf.png",
    "utilisation.png",
)
POLICIES = ("static", "time_window", "fcfs")


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def check_pngs(folder):
    for name in ("throughput.png", "latency_cdf.png", "utilisation.png"):
        with open(os.path.join(folder, name), "rb") as f:
            data = f.read()
        assert len(data) > 1000 and data.startswith(PNG_SIGNATURE), name


def test_end_to_end_in_a_subprocess(tmp_path):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    # max_num_seqs=3 differs from the file's 4: the override must reach the engines, not just config.json.
    cmd = [
        sys.executable,
        "-m",
        "experiments.compare_policies",
        f"--config={TINY}",
        f"--config.output_dir={tmp_path}",
        "--config.run_name=e2e",
        "--config.engine.max_num_seqs=3",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    folder = tmp_path / "e2e"
    for name in FILES:
        assert (folder / name).is_file() and (folder / name).stat().st_size > 0, name
    check_pngs(folder)

    config = json.loads((folder / "config.json").read_text())
    assert config["engine"]["max_num_seqs"] == 3 and config["model"] == "test-tiny"
    manifest = json.loads((folder / "manifest.json").read_text())
    assert set(manifest["engines"]) == set(POLICIES)
    assert all(e["config"]["max_num_seqs"] == 3 for e in manifest["engines"].values())
    assert manifest["engines"]["time_window"]["config"]["policy"] == "static"
    assert manifest["engines"]["time_window"]["client"] == {"window_s": 0.05, "max_batch": 4}
    assert manifest["device"]["count"] >= 1 and manifest["versions"]["jax"]
    assert isinstance(manifest["host"]["cpu"], str) and manifest["host"]["cpu"]
    assert manifest["command_line"][1:] == cmd[3:] and manifest["interrupted"] is False

    summary = json.loads((folder / "summary.json").read_text())
    assert [s["policy"] for s in summary] == list(POLICIES)
    for s in summary:
        assert s["num_requests"] == 12 and s["num_completed"] == 12 and s["output_throughput"] > 0
        assert s["compiles_after_first_step"] == 0  # warmup compiled every bucket
    by_policy = {s["policy"]: s for s in summary}
    ratio = by_policy["fcfs"]["output_throughput"] / by_policy["static"]["output_throughput"]
    assert by_policy["fcfs"]["output_throughput_vs_static"] == pytest.approx(ratio)
    assert f"output throughput: {ratio:.2f}x" in proc.stdout
    ttft = by_policy["static"]["ttft_ms_p50"] / by_policy["fcfs"]["ttft_ms_p50"]
    assert f"TTFT p50 {ttft:.1f}x lower" in proc.stdout
    csv_lines = (folder / "summary.csv").read_text().splitlines()
    assert csv_lines[0].startswith("policy,") and len(csv_lines) == 4

    requests = read_jsonl(folder / "requests.jsonl")
    steps = read_jsonl(folder / "steps.jsonl")
    for policy in POLICIES:
        mine = [r for r in requests if r["policy"] == policy]
        assert len(mine) == 12 and all(r["first_scheduled_time"] >= r["arrival_time"] for r in mine)
        assert {s["max_num_seqs"] for s in steps if s["policy"] == policy} == {3}
        assert max(s["num_scheduled_seqs"] for s in steps if s["policy"] == policy) <= 3

    for policy in POLICIES:
        assert any(line.startswith(policy) for line in proc.stdout.splitlines()), proc.stdout


def test_ctrl_c_writes_what_was_measured(tmp_path):
    argv = [f"--config={TINY}", f"--config.output_dir={tmp_path}", "--config.run_name=cut"]
    cfg = cp.resolve_config(parse(argv))

    def interrupt(policy, progress):
        if policy == "time_window" and progress.num_steps == 5:
            raise KeyboardInterrupt

    comp = cp.run_comparison(cfg, progress=False, on_step=interrupt)
    assert comp.interrupted and list(comp.results) == ["static", "time_window"]  # fcfs never started
    assert not comp.results["static"].interrupted and comp.results["time_window"].interrupted
    summaries = cp.summaries_of(cfg, comp)
    folder = tmp_path / "cut"
    folder.mkdir()
    cp.write_results(comp, summaries, str(folder), datetime.datetime.now())
    for name in FILES[1:]:
        assert (folder / name).is_file(), name
    check_pngs(folder)
    cut = summaries["time_window"]
    assert cut["interrupted"] and cut["num_completed"] < 12 and len(comp.results["time_window"].steps) == 5
    assert summaries["static"]["num_completed"] == 12
    assert "fcfs" not in tables.format_table(summaries) and tables.ratio_line(summaries) is None


def test_table_shows_missing_values_as_dashes():
    nan = math.nan
    row = {key: nan for _, key, _ in tables.COLUMNS}
    row.update(request_throughput=2.0, output_throughput=50.0, request_preemptions=3, slot_occupancy_mean=0.5)
    table = tables.format_table({"static": row, "fcfs": {**row, "output_throughput": 125.0}})
    lines = table.splitlines()
    assert lines[0].split()[0] == "policy" and len(lines) == 4
    assert lines[2].split()[:3] == ["static", "2.00", "50.0"] and "50%" in lines[2] and "-" in lines[2].split()
    assert lines[3].split()[2] == "125.0"


@pytest.mark.parametrize("bad", [dict(clock="sundial"), dict(step_cost_ms=5.0)])
def test_resolve_config_checks_the_clock(bad):
    cfg = parse([])  # compare_cpu: real clock
    for k, v in bad.items():
        setattr(cfg, k, v)
    with pytest.raises(ValueError, match="clock"):
        cp.resolve_config(cfg)


def test_variants_and_every_policy_generate_the_same_tokens(tmp_path):
    # Engine policies, a variant with the prefix cache and swap, one shared engine shape: greedy outputs agree.
    argv = [
        f"--config={TINY}",
        "--config.policies=fcfs,sjf,srpt_oracle,cached_swap",
        "--config.variants={'cached_swap': {'policy': 'mlfq', 'enable_prefix_caching': True, "
        "'preemption_mode': 'swap', 'num_host_pages': 32}}",
        "--config.policy_options={'srpt_oracle': {'victim': 'cheapest_recompute'}, 'cached_swap': {'quantum': 4}}",
    ]
    cfg = cp.resolve_config(parse(argv))
    comp = cp.run_comparison(cfg, progress=False)
    summaries = cp.summaries_of(cfg, comp)
    assert list(summaries) == ["fcfs", "sjf", "srpt_oracle", "cached_swap"]
    assert comp.engines["cached_swap"]["config"]["preemption_mode"] == "swap"
    assert comp.engines["cached_swap"]["config"]["enable_prefix_caching"] is True
    assert comp.engines["srpt_oracle"]["config"]["policy_options"] == {"victim": "cheapest_recompute"}
    for s in summaries.values():
        assert s["num_completed"] == 12 and s["same_outputs"] == 1.0 and s["num_compared_outputs"] == 12
    assert tables.outputs_line(summaries).startswith("outputs: every entry generated exactly fcfs's tokens")
    cp.write_results(comp, summaries, str(tmp_path), datetime.datetime.now())  # nested options are JSON-safe
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["engines"]["cached_swap"]["config"]["policy_options"] == {"quantum": 4}
    with pytest.raises(ValueError, match="unknown engine option"):
        cp.resolve_config(
            parse(
                [f"--config={TINY}", "--config.policies=v", "--config.variants={'v': {'policy': 'fcfs', 'swap': True}}"]
            )
        )


# ------------------------------------------------------------------------------------ checked before anything runs
def run_main(*args, timeout=120):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-m", "experiments.compare_policies", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_a_missing_config_file_is_one_clear_line(tmp_path):
    proc = run_main(f"--config={tmp_path / 'nope.py'}", f"--config.output_dir={tmp_path}")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("compare_policies: cannot load the --config file: ") and "No such file" in last
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    "override, message",
    [
        ("--config.workload.kind=bogus", "kind must be one of"),
        ("--config.engine.kv_cache_memory_gib=-1.0", "kv_cache_memory_gib must be a finite number > 0.0"),
        ("--config.model=no-such-model", "unknown model 'no-such-model'"),
        ("--config.variants={'v': {'policy': 'fcfs', 'page_size': 0}}", "entry 'v'.*page_size"),
    ],
)
def test_a_bad_option_is_refused_before_anything_is_written(tmp_path, override, message):
    earlier = tmp_path / "compare_tiny"
    earlier.mkdir()
    (earlier / "config.json").write_text("an earlier run's config\n")
    extra = ["--config.policies=fcfs,v"] if "variants" in override else []
    proc = run_main(f"--config={TINY}", f"--config.output_dir={tmp_path}", override, *extra)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert re.search(message, proc.stderr.strip().splitlines()[-1]), proc.stderr[-2000:]
    assert sorted(os.listdir(tmp_path)) == ["compare_tiny"]
    assert (earlier / "config.json").read_text() == "an earlier run's config\n"


def test_a_run_never_replaces_another_runs_folder(tmp_path):
    from cbjax.bench.results import run_dir

    first = run_dir(str(tmp_path), "run")
    assert first == str(tmp_path / "run")
    assert run_dir(str(tmp_path), "run") == first  # still empty: nothing to protect
    (tmp_path / "run" / "config.json").write_text("{}")
    second = run_dir(str(tmp_path), "run")
    assert second == str(tmp_path / "run_2") and os.path.isdir(second)
    (tmp_path / "run_2" / "config.json").write_text("{}")
    assert run_dir(str(tmp_path), "run") == str(tmp_path / "run_3")
    assert run_dir(str(tmp_path), "run", overwrite=True) == first
    with pytest.raises(ValueError, match="run_name"):
        run_dir(str(tmp_path), "../up")


def test_ctrl_c_while_an_engine_is_built_keeps_what_was_measured(tmp_path, monkeypatch):
    """A real SIGINT, as Ctrl-C sends it, in the middle of building the second engine: no exception escapes, the
    first policy's results are kept, the second is not run."""
    import signal

    import cbjax.engine

    cfg = cp.resolve_config(parse([f"--config={TINY}", "--config.policies=fcfs,static"]))
    real_engine = cbjax.engine.LLMEngine
    started, built = [], []

    def engine_interrupted_while_building(*args, **kwargs):
        started.append(1)
        if len(started) == 2:
            os.kill(os.getpid(), signal.SIGINT)  # handled between bytecodes, inside the constructor
        built.append(real_engine(*args, **kwargs))
        return built[-1]

    monkeypatch.setattr(cbjax.engine, "LLMEngine", engine_interrupted_while_building)
    before = signal.getsignal(signal.SIGINT)
    comp = cp.run_comparison(cfg, progress=False)
    assert len(built) == 2  # the interrupted constructor ran to its end: no KeyboardInterrupt inside jax
    assert comp.interrupted and list(comp.results) == ["fcfs"] and not comp.results["fcfs"].interrupted
    assert signal.getsignal(signal.SIGINT) is before  # restored


def test_ctrl_c_during_a_run_stops_at_the_next_step(tmp_path):
    import signal

    cfg = cp.resolve_config(parse([f"--config={TINY}", "--config.policies=fcfs,static"]))

    def ctrl_c_at_step_3(policy, progress):
        if progress.num_steps == 3:
            os.kill(os.getpid(), signal.SIGINT)

    comp = cp.run_comparison(cfg, progress=False, on_step=ctrl_c_at_step_3)
    assert comp.interrupted and list(comp.results) == ["fcfs"]
    assert comp.results["fcfs"].interrupted and len(comp.results["fcfs"].steps) == 3


def test_ctrl_c_in_a_real_run_writes_the_results_and_exits_normally(tmp_path):
    """The command line, interrupted by SIGINT as soon as the first engine is being built."""
    import signal

    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    # Ctrl-C's default handling, whatever this process inherited (a job started in the background ignores SIGINT).
    launch = (
        "import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
        "sys.argv[0] = 'compare_policies'; runpy.run_module('experiments.compare_policies', run_name='__main__')"
    )
    cmd = [sys.executable, "-c", launch, f"--config={TINY}", f"--config.output_dir={tmp_path}", "--config.run_name=cut"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in proc.stderr:
        if "static: engine policy=static" in line:  # logged just before the engine is built
            proc.send_signal(signal.SIGINT)
            break
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-3000:]
    assert "Traceback" not in stderr and "interrupted:" in stdout
    manifest = json.loads((tmp_path / "cut" / "manifest.json").read_text())
    assert manifest["interrupted"] is True
    assert (tmp_path / "cut" / "summary.json").is_file()


def test_data_parallel_routers_compare_like_policies(tmp_path):
    argv = [
        f"--config={TINY}",
        "--config.policies=fcfs,rr,affinity",
        "--config.variants={'rr': {'policy': 'fcfs', 'data_parallel_size': 2, 'router': 'round_robin'}, "
        "'affinity': {'policy': 'fcfs', 'data_parallel_size': 2, 'router': 'prefix_affinity', "
        "'router_options': {'prefix_tokens': 8}}}",
    ]
    cfg = cp.resolve_config(parse(argv))
    comp = cp.run_comparison(cfg, progress=False)
    summaries = cp.summaries_of(cfg, comp)
    for name in ("rr", "affinity"):
        assert summaries[name]["num_completed"] == 12 and summaries[name]["same_outputs"] == 1.0
        assert {s.replica for s in comp.results[name].steps} == {0, 1}  # both replicas ran steps
    assert {s.replica for s in comp.results["fcfs"].steps} == {0}
    cp.write_results(comp, summaries, str(tmp_path), datetime.datetime.now())


@pytest.mark.parametrize(
    "variant, message",
    [
        ("{'v': {'policy': 'fcfs', 'data_parallel_size': 0}}", "data_parallel_size must be an integer >= 1"),
        ("{'v': {'policy': 'fcfs', 'data_parallel_size': 2, 'router': 'nearest'}}", "router must be one of"),
    ],
)
def test_bad_data_parallel_options_are_refused_before_the_run(variant, message):
    with pytest.raises(ValueError, match=message):
        cp.resolve_config(parse([f"--config={TINY}", "--config.policies=v", f"--config.variants={variant}"]))


def test_repeats_interleave_the_policies_and_give_intervals_and_paired_ratios(tmp_path):
    argv = [f"--config={TINY}", "--config.repeats=2", "--config.baseline=fcfs"]
    cfg = cp.resolve_config(parse(argv))
    starts = []

    def record(policy, progress):
        if progress.num_steps == 1:
            starts.append(policy)

    comp = cp.run_comparison(cfg, progress=False, on_step=record)
    # Repeat 2 starts one entry later: a slow minute of the machine does not always fall on the same policy.
    assert starts == ["static", "time_window", "fcfs", "time_window", "fcfs", "static"]
    assert comp.num_repeats == 2 and list(comp.results) == list(POLICIES)
    assert all(comp.repeats[p][0] is comp.results[p] for p in POLICIES)
    summaries = cp.summaries_of(cfg, comp)
    for s in summaries.values():
        assert s["repeats"] == 2
        for key in tables.INTERVAL_METRICS:
            low, high = s[f"{key}_ci"]
            assert low <= s[key] <= high and sorted(s[f"{key}_runs"]) == [low, high]  # 2 repeats: the two runs
    fcfs = summaries["fcfs"]
    assert all(fcfs[f"{k}_ratio"] == 1.0 and not fcfs[f"{k}_significant"] for k in tables.INTERVAL_METRICS)
    table = tables.interval_table(summaries, "fcfs")
    assert table.startswith("medians over 2 repeats") and "paired ratio to fcfs" in table
    assert tables.interval_table(summaries) is not None and "ratio" not in tables.interval_table(summaries)
    cp.write_results(comp, summaries, str(tmp_path), datetime.datetime.now())
    requests = read_jsonl(tmp_path / "requests.jsonl")
    assert {(r["policy"], r["repeat"]) for r in requests} == {(p, i) for p in POLICIES for i in (0, 1)}
    assert len(requests) == 12 * 2 * len(POLICIES)
    assert json.loads((tmp_path / "manifest.json").read_text())["repeats"] == 2
    with pytest.raises(ValueError, match="baseline"):
        cp.resolve_config(parse([f"--config={TINY}", "--config.baseline=sjf"]))
    with pytest.raises(ValueError, match="repeats"):
        cp.resolve_config(parse([f"--config={TINY}", "--config.repeats=0"]))


def test_seeds_spread_a_deterministic_run_over_workloads_and_keep_the_runs_paired():
    # The simulator repeats exactly; seeds give it a spread: run i of every policy has the workload of seed i.
    argv = [
        f"--config={TINY}",
        "--config.engine.runner=sim",
        "--config.sim.accelerator=h200",
        "--config.step_cost_ms=0",
        "--config.seeds=3",
        "--config.baseline=static",
    ]
    cfg = cp.resolve_config(parse(argv))
    comp = cp.run_comparison(cfg, progress=False)
    assert comp.num_repeats == 3
    prompts = {p: [sorted(r.prompt_len for r in res.requests) for res in comp.repeats[p]] for p in POLICIES}
    assert prompts["fcfs"] == prompts["static"] and len({tuple(x) for x in prompts["fcfs"]}) == 3  # 3 workloads
    summaries = cp.summaries_of(cfg, comp)
    low, high = summaries["fcfs"]["output_throughput_ci"]
    assert low < high  # the seeds' spread, where repeats alone would give a point
    assert not summaries["static"]["output_throughput_significant"]  # the baseline against itself
    with pytest.raises(ValueError, match="seeds"):
        cp.resolve_config(parse([f"--config={TINY}", "--config.seeds=0"]))
