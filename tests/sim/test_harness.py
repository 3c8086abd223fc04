"""The experiment harness on the simulator: the sim settings are checked before anything runs, and the load sweep
draws latency against load from the same runs compare_policies makes."""

import pytest

from experiments import compare_policies as cp
from experiments import sim_sweep
from tests.helpers import parse_config

SIM = ["--config.engine.runner=sim", "--config.clock=virtual", "--config.sim.accelerator=h200"]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["--config.engine.runner=sim", "--config.sim.accelerator=h200"], "clock='virtual'"),
        (["--config.engine.runner=sim", "--config.clock=virtual"], "exactly one of"),
        ([*SIM, "--config.sim.profile=/no/such/profile.json"], "exactly one of"),
        (["--config.engine.runner=sim", "--config.clock=virtual", "--config.sim.profile=/no/such.json"], "cannot read"),
        ([*SIM, "--config.sim.num_chips=0"], "sim_num_chips"),
        (["--config.engine.runner=gpu"], "runner must be one of"),
    ],
)
def test_sim_settings_are_checked_before_the_run(overrides, message):
    with pytest.raises(ValueError, match=message):
        cp.resolve_config(parse_config(overrides))


def test_the_sweep_draws_latency_against_load():
    cfg = parse_config(
        ["--config.policies=fcfs", "--config.workload.num_requests=80", "--config.sweep.rates=8,80"],
        "configs/sim_sweep.py",
    )
    with cfg.unlocked():
        cfg.policy_options = {}
    rates = sim_sweep.rates_of(cfg)
    cfg, _ = cp.prepare_run(cfg)
    rows = sim_sweep.sweep(cfg, rates)
    assert [(r["rate"], r["policy"]) for r in rows] == [(8.0, "fcfs"), (80.0, "fcfs")]
    low, high = rows
    assert low["num_completed"] == high["num_completed"] == 80
    assert high["ttft_ms_p99"] > low["ttft_ms_p99"]  # 80/s is well above what the profile serves (~25/s)
    assert high["wall_s"] < 30


@pytest.mark.parametrize("rates", [(), ("x",), (-1.0,)])
def test_bad_sweep_rates_are_refused(rates):
    cfg = parse_config([], "configs/sim_sweep.py")
    cfg.sweep.rates = rates
    with pytest.raises(ValueError, match=r"sweep\.rates"):
        sim_sweep.rates_of(cfg)
