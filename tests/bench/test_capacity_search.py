"""The capacity-under-SLO search (cbjax/bench/capacity_search.py) on attainment curves known in closed form."""

import math

import pytest

from cbjax.bench.capacity_search import Probe, search_capacity


def curve(knee: float):
    """Attainment 1 up to `knee` requests/s, then falling linearly to 0 at 2 x knee: the target 0.9 is met up to
    exactly 1.1 x knee."""
    calls = []

    def attainment_at(rate):
        calls.append(rate)
        return Probe(rate, max(0.0, min(1.0, 1.0 - (rate - knee) / knee)))

    return attainment_at, calls


@pytest.mark.parametrize("start", [0.3, 10.0, 55.0, 400.0])
def test_the_search_finds_the_rate_where_attainment_crosses_the_target(start):
    attainment_at, calls = curve(knee=20.0)
    res = search_capacity(attainment_at, start, target=0.9, tolerance=0.01, max_probes=40)
    assert res.bounded and 22.0 * 0.99 <= res.capacity <= 22.0  # never above the true capacity
    assert res.missed_above > 22.0 and res.missed_above <= res.capacity * 1.011
    assert [p.rate for p in res.probes] == calls and len(calls) <= 40


def test_an_slo_out_of_reach_gives_zero_and_an_endless_one_stays_unbounded():
    res = search_capacity(lambda r: Probe(r, 0.5), 10.0, target=0.9)
    assert res.capacity == 0.0 and res.bounded and [p.rate for p in res.probes] == [10.0, 0.5]
    res = search_capacity(lambda r: Probe(r, 1.0), 10.0, max_probes=5)
    assert not res.bounded and res.capacity == 80.0 and res.missed_above == math.inf


def test_a_nan_attainment_counts_as_a_miss_and_bad_arguments_are_refused():
    res = search_capacity(lambda r: Probe(r, math.nan if r > 5 else 1.0), 4.0, tolerance=0.05)
    assert 4.75 <= res.capacity <= 5.0
    with pytest.raises(ValueError, match="target"):
        search_capacity(lambda r: Probe(r, 1.0), 1.0, target=1.5)
    with pytest.raises(ValueError, match="start_rate"):
        search_capacity(lambda r: Probe(r, 1.0), 0.0)


def test_the_capacity_command_searches_each_policy_on_the_simulator(tmp_path):
    # test-tiny through the simulator's H200 roofline (deterministic), two policies, one seed: the search ends with
    # a probe that meets the SLO at the capacity and one that misses within the tolerance above it.
    from experiments import capacity
    from experiments import compare_policies as cp
    from tests.bench.test_compare_policies import TINY
    from tests.helpers import parse_config as parse

    argv = [f"--config={TINY}", "--config.engine.runner=sim", "--config.sim.accelerator=h200", "--config.clock=virtual",
            "--config.step_cost_ms=0", "--config.policies=fcfs,static", "--config.workload.num_requests=40",
            "--config.slo.ttft_ms=50", "--config.slo.tpot_ms=5"]  # fmt: skip
    cfg = cp.resolve_config(parse(argv))
    settings = capacity.search_settings(cfg)
    results = capacity.search_all(cfg, settings, start_rate=100.0)
    for name in ("fcfs", "static"):
        (res,) = results[name]
        assert res.bounded and res.capacity > 0
        assert any(p.rate == res.capacity and p.attainment >= 0.9 for p in res.probes)
        assert res.missed_above <= res.capacity * (1 + settings["tolerance"]) + 1e-9
    assert results["fcfs"][0].capacity > results["static"][0].capacity  # continuous batching sustains more
    text = capacity.table(results, settings, None)
    assert text.splitlines()[2].startswith("| fcfs | ")
    assert capacity.plot(str(tmp_path / "c.png"), results).endswith("c.png")


def test_the_real_check_runs_the_model_at_the_rate_and_above_it():
    from experiments import capacity
    from experiments import compare_policies as cp
    from tests.bench.test_compare_policies import TINY
    from tests.helpers import parse_config as parse

    argv = [f"--config={TINY}", "--config.policies=fcfs,static", "--config.workload.num_requests=6",
            "--config.slo.ttft_ms=60000", "--config.repeats=1"]  # fmt: skip
    cfg = cp.resolve_config(parse(argv))
    settings = {**capacity.search_settings(cfg), "real_policies": ["fcfs"]}
    checks = capacity.check_on_real(cfg, settings, {"fcfs": 4.0, "static": 2.0})
    assert list(checks) == ["fcfs"] and checks["fcfs"]["above"] == pytest.approx(4.4)
    assert checks["fcfs"]["at"] == [1.0] and checks["fcfs"]["above_runs"] == [1.0]  # a minute of TTFT: all in SLO
    with cfg.unlocked():
        cfg.capacity_search = {"real_policies": "fcfs,nope"}
    with pytest.raises(ValueError, match=r"real_policies names policies not in config.policies: \['nope'\]"):
        capacity.search_settings(cfg)
