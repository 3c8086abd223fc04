"""Experiment configs: each loads, names only real engine/workload/SLO fields, and command-line overrides apply.

No engine is built here (no jax compile): the end-to-end run with an override is in test_compare_policies.py.
"""

import glob
import os

import pytest

from cbjax.bench.metrics import SLO_KEYS
from cbjax.bench.online import POLICY_NAMES
from cbjax.bench.workload import make_workload
from cbjax.core.policy_zoo import POLICIES
from cbjax.engine import EngineConfig
from cbjax.model.config import get_model_config
from experiments.compare_policies import DATA_PARALLEL_OPTIONS, resolve_config
from experiments.load_harness import load_of, workload_config
from tests.helpers import ROOT
from tests.helpers import parse_config as parse

# The comparison family: every config of experiments/compare_policies.
CONFIGS = sorted(
    glob.glob(os.path.join(ROOT, "configs", "compare_*.py"))
    + glob.glob(os.path.join(ROOT, "configs", "sim_*.py"))
    + [
        os.path.join(ROOT, "configs", f)
        for f in (
            "base.py",
            "policy_zoo.py",
            "prefix_cache.py",
            "preemption.py",
            "sliding_window.py",
            "routers.py",
            "kv_int8.py",
        )
    ]
)
ENGINE_FIELDS = set(EngineConfig.option_defaults())


def test_the_expected_configs_exist():
    names = {os.path.basename(p) for p in CONFIGS}
    assert {"compare_cpu.py", "compare_mixed.py", "compare_tiny.py", "policy_zoo.py"} <= names
    zoo = resolve_config(parse([f"--config={os.path.join(ROOT, 'configs', 'policy_zoo.py')}"]))
    assert set(POLICIES) <= set(zoo.policies), "the zoo runs every engine policy"


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_config_fields_are_real(path):
    cfg = resolve_config(parse([f"--config={path}"]))
    assert set(cfg.engine) <= ENGINE_FIELDS - {"policy"}  # each policy entry sets the engine's policy
    EngineConfig.from_options(policy="fcfs", **cfg.engine)  # every value is acceptable to the engine's config
    assert cfg.policies and all(p in POLICY_NAMES or p in cfg.variants for p in cfg.policies)
    for variant in cfg.variants.values():  # (the data-parallel keys build replicas, not an engine option)
        EngineConfig.from_options(
            **{k: v for k, v in {**cfg.engine, **variant}.items() if k not in DATA_PARALLEL_OPTIONS}
        )
    assert set(cfg.slo) == set(SLO_KEYS)
    assert set(cfg.time_window) == {"window_ms", "max_batch"}
    get_model_config(cfg.model)
    # make_workload rejects unknown fields, so this checks the names too (a load's rate waits on a measured capacity)
    wl = make_workload(workload_config(cfg, offline=load_of(cfg) is not None))
    assert len(wl) == cfg.workload.num_requests
    assert max(r.prompt_len + r.max_tokens for r in wl) <= cfg.engine.max_model_len
    assert max(max(r.prompt_token_ids) for r in wl) < get_model_config(cfg.model).vocab_size


def test_command_line_overrides_take_effect():
    cfg = parse(
        [
            f"--config={ROOT}/configs/compare_cpu.py",
            "--config.engine.max_num_seqs=7",
            "--config.workload.load=0",  # the main job's load off: its rate absolute
            "--config.workload.request_rate=3.5",
            "--config.slo.e2e_ms=5000",
            "--config.policies=fcfs,static",
            "--config.run_name=x",
        ]
    )
    assert cfg.engine.max_num_seqs == 7 and cfg.workload.request_rate == 3.5 and cfg.slo.e2e_ms == 5000.0
    assert load_of(cfg) is None
    assert cfg.run_name == "x"
    assert resolve_config(cfg).policies == ("fcfs", "static")  # a comma-separated entry is split


def test_a_misspelt_override_is_an_error():
    with pytest.raises(AttributeError, match='Did you mean "max_num_seqs"'):
        parse(["--config.engine.max_num_seq=7"])


def test_resolve_config_rejects_bad_policy_lists():
    with pytest.raises(ValueError, match="unknown policy"):
        resolve_config(parse(["--config.policies=fcfs,nope"]))
    with pytest.raises(ValueError, match="takes no option"):
        resolve_config(
            parse(["--config.policies=fcfs,priority", "--config.policy_options={'priority': {'agin_s': 3}}"])
        )
    with pytest.raises(ValueError, match=r"not in config\.policies: \['sjff'\]"):
        resolve_config(parse(["--config.policies=fcfs", "--config.policy_options={'sjff': {}}"]))
    # a known policy left out of the list (the zoo's config run for two of its policies): its options are unused
    assert resolve_config(parse(["--config.policies=fcfs", "--config.policy_options={'sjf': {}}"])).policies == (
        "fcfs",
    )


def test_engine_policy_runs_one_policy_alone():
    cfg = resolve_config(parse(["--config.engine.policy=srpt_oracle"]))
    assert cfg.policies == ("srpt_oracle",) and "policy" not in cfg.engine
    with pytest.raises(ValueError, match="twice"):
        resolve_config(parse(["--config.policies=fcfs,fcfs"]))


def test_derived_configs_inherit_the_main_one():
    base = parse([])
    mixed = parse([f"--config={os.path.join(ROOT, 'configs', 'compare_mixed.py')}"])
    assert mixed.workload.arrival == "offline" and mixed.policies == ("static", "fcfs")
    assert mixed.engine.max_num_batched_tokens == base.engine.max_num_batched_tokens
