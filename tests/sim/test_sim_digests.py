"""The simulator's decisions do not change when its code is made faster: every zoo entry runs a small workload of
configs/sim_zoo.py and the digests of its step records, request records and outputs (experiments/sim_digests.py) must
equal those recorded in tests/sim/data/sim_zoo_digests.json, made on the tree before the speed-ups of issue 37.

A change meant to alter decisions (a policy's rule, the committed profile, the workload's generator) changes them
too: rerecord with the command in the data file and say why in the commit."""

import json
import os

from experiments import compare_policies as cp
from experiments import sim_digests
from tests.helpers import parse_config

DATA = os.path.join(os.path.dirname(__file__), "data", "sim_zoo_digests.json")


def _recorded() -> dict:
    with open(DATA) as f:
        return json.load(f)


def test_every_zoo_entry_decides_as_recorded():
    recorded = _recorded()
    names = [k for k in recorded["digests"] if k != "capacity_request_rate"]
    cfg = parse_config([f"--config.workload.num_requests={recorded['num_requests']}"], "configs/sim_zoo.py")
    with cfg.unlocked():
        cfg.policies = tuple(names)
        cfg.policy_options = {k: v for k, v in cfg.policy_options.items() if k in names}
    cfg, workload = cp.prepare_run(cfg)
    got = sim_digests.comparison_digests(cfg, workload)
    assert sim_digests.differences(recorded["digests"], got) == []


def test_a_changed_decision_changes_the_digests():
    recorded = _recorded()["digests"]
    changed = dict(recorded["fcfs"], steps="0" * 64)
    assert sim_digests.differences(recorded, {**recorded, "fcfs": changed}) == [
        f"fcfs: expected {recorded['fcfs']}, got {changed}"
    ]
