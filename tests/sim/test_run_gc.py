"""The cyclic collector around a simulated run (cbjax/bench/run_gc.py): off while the simulator runs, back on after
(and on throughout a run on the real engine), nothing left frozen; the run's objects joined the oldest generation
instead of waiting in the young one."""

import gc

from cbjax.bench.run_gc import run_objects_only
from experiments import compare_policies as cp
from tests.helpers import parse_config


def test_a_paused_run_turns_the_collector_off_and_back_on_and_unfreezes():
    assert gc.isenabled() and gc.get_freeze_count() == 0
    with run_objects_only(pause=True) as frozen:
        assert frozen and not gc.isenabled()
        made = [[] for _ in range(1000)]  # the run's objects, young until the run ends
    assert gc.isenabled() and gc.get_freeze_count() == 0
    assert gc.get_count()[0] < len(made)  # they went to the oldest generation, not through a young collection
    with run_objects_only() as frozen:  # a real engine's run: the collector stays on
        assert frozen and gc.isenabled()
    assert gc.get_freeze_count() == 0


def test_a_run_inside_a_frozen_caller_pauses_but_leaves_the_callers_freeze():
    gc.freeze()
    try:
        with run_objects_only(pause=True) as frozen:
            assert not frozen and not gc.isenabled()
        assert gc.isenabled() and gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()


def test_the_simulated_zoo_run_has_the_collector_off_while_it_steps():
    cfg = parse_config(["--config.policies=fcfs", "--config.workload.num_requests=40"], "configs/sim_zoo.py")
    with cfg.unlocked():
        cfg.policy_options = {}
    cfg, requests = cp.prepare_run(cfg)
    seen = set()
    comp = cp.run_comparison(cfg, workload=requests, progress=False, on_step=lambda name, p: seen.add(gc.isenabled()))
    assert comp.results["fcfs"].steps and seen == {False}  # (the capacity run's steps too)
    assert gc.isenabled()
