"""The predictor-error study's config (configs/length_prediction.py) and the docs' view of its data
(experiments/doc_views.py, `length_prediction`)."""

from cbjax.core.length_predictor import LearnedPredictor, NoisyPredictor, OraclePredictor
from cbjax.engine_config import EngineConfig
from experiments.comparison_config import engine_options, resolve_config
from experiments.doc_views import VIEWS
from tests.helpers import parse_config

CONFIG = "configs/length_prediction.py"


def test_the_study_runs_every_length_aware_policy_with_every_predictor_on_the_simulator():
    cfg = resolve_config(parse_config([], CONFIG))
    assert cfg.engine.runner == "sim" and cfg.seeds > 1 and cfg.baseline == "fcfs"
    assert cfg.workload.load is not None and cfg.horizon_after_last_arrival_s is None
    assert len(cfg.policies) == 2 + 5 * 6
    sigmas = set()
    for name in cfg.policies[2:]:
        options = engine_options(cfg, name)[1]
        policy = EngineConfig.from_options(**options).scheduler.make_policy()
        assert policy.name == name.rsplit("_", 1)[0]
        predictor = policy.predictor
        assert isinstance(predictor, (OraclePredictor, NoisyPredictor, LearnedPredictor))
        if isinstance(predictor, NoisyPredictor):
            sigmas.add(predictor.sigma)
    assert sigmas == {0.25, 0.5, 1.0, 2.0}


def _data():
    runs = []
    for entry, ttft in (("fcfs", [100, 200, 300]), ("sjf", [50, 100, 150]), ("hrrn_s05", [80, 160, 240])):
        runs += [{"policy": entry, "run": i + 1, "ttft_ms_p50": t} for i, t in enumerate(ttft)]
    config = {
        "variants": {"hrrn_s05": {"policy": "hrrn"}},
        "policy_options": {"hrrn_s05": {"length_predictor": "noisy", "sigma": 0.5}},
    }
    return {"config": config, "runs": runs}


def test_the_view_puts_each_predictor_in_a_column_as_a_ratio_to_fcfs():
    table = VIEWS["length_prediction"](_data(), metric="ttft_ms_p50")
    lines = table.splitlines()
    assert lines[2] == "| policy | no predictor | noisy sigma=0.5 |"
    assert lines[4] == "| fcfs | - |  |"
    assert lines[5].startswith("| sjf | 0.50x")
    assert lines[6].startswith("| hrrn |  | 0.80x")
    assert "over fcfs's (200" in lines[0]
