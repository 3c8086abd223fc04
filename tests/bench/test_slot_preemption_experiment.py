"""configs/slot_preemption.py and its figure (experiments/slot_preemption_figure.py), without running an engine."""

import os

from cbjax.bench.workload import make_workload
from cbjax.core.policy_zoo import make_policy
from cbjax.engine import EngineConfig
from experiments import slot_preemption_figure as figure
from experiments.compare_policies import resolve_config
from experiments.load_harness import workload_config
from tests.helpers import ROOT
from tests.helpers import parse_config as parse

CONFIG = os.path.join(ROOT, "configs", "slot_preemption.py")


def test_the_config_compares_the_option_off_and_on_where_only_slots_run_out():
    cfg = resolve_config(parse([f"--config={CONFIG}"]))
    assert cfg.policies == ("off", "on")
    for name, on in (("off", False), ("on", True)):
        EngineConfig.from_options(**{**cfg.engine, **cfg.variants[name]})
        assert make_policy(cfg.variants[name]["policy"], dict(cfg.policy_options[name])).preempt_for_slot is on
    # Pages never run out: even every slot holding a request of max_model_len leaves pages free.
    assert cfg.engine.max_num_seqs * cfg.engine.max_model_len < cfg.engine.num_pages * cfg.engine.page_size
    reqs = make_workload(workload_config(cfg, offline=True))
    # The important class is the short one, so the summaries' short_* columns are its figures.
    assert {(r.length_class, r.priority) for r in reqs} == {("short", 0), ("long", 1)}


def test_the_figure_shows_the_median_of_the_runs_of_each_entry(tmp_path):
    runs = [
        {"policy": p, "run": i, "short_ttft_ms_p50": v, "short_ttft_ms_p99": 10 * v, "long_ttft_ms_p50": 2 * v,
         "long_ttft_ms_p99": 20 * v}
        for p, values in (("off", [3.0, 1.0, 2.0]), ("on", [5.0, 4.0, 6.0]))
        for i, v in enumerate(values)
    ]  # fmt: skip
    data = {"runs": runs, "load": {"load": 0.7}}
    ivs = figure.intervals(data)
    assert ivs["off", "short", "p50"][0] == 2.0 and ivs["on", "long", "p99"][0] == 100.0
    assert ivs["off", "short", "p50"][1] <= 2.0 <= ivs["off", "short", "p50"][2]
    out = figure.plot([data, data], str(tmp_path / "fig.png"))
    assert os.path.getsize(out) > 1000
