"""sim_profile="auto" and the origin of profiles: the cache key follows the machine, jax, the step's code and the
engine shape (and nothing else), a cached profile is reused without calibrating again, and a profile made
elsewhere (or recording no origin) is loaded with a warning that says why. The real calibration takes a minute or
two, so here a counting stand-in replaces it; docs/sim.md has the real one's times."""

import json
import logging
import pathlib

import pytest

from cbjax import LLMEngine, SamplingParams, sim_calibration
from cbjax.engine_config import EngineConfig
from cbjax.model.config import get_model_config
from cbjax.sim import AUTO_PROFILE, CalibratedCost, FixedCost, RooflineCost, auto_profile, provenance, save_profile
from tests.helpers import ROOT
from tests.helpers import parse_config as parse

ORIGIN = dict(cpu="AMD EPYC 9R14 (family 25, model 17)", cpu_count=2, jax="0.10.2", jaxlib="0.10.2",
              accelerator_packages={}, jax_platforms="cpu", code_fingerprint="0123456789abcdef")  # fmt: skip
SIM = dict(runner="sim", sim_profile=AUTO_PROFILE, max_num_seqs=8, max_num_batched_tokens=64, num_pages=64,
           max_model_len=256)  # fmt: skip


def key(origin=None, model="test-tiny", **options) -> str:
    config = EngineConfig.from_options({**SIM, **options})
    return auto_profile.setup_key(auto_profile.setup_of(config, get_model_config(model), origin or ORIGIN))


def test_the_key_follows_the_machine_jax_code_model_and_engine_shape():
    assert key() == key()
    different = [
        key(dict(ORIGIN, cpu="AMD EPYC (family 26, model 2)")),
        key(dict(ORIGIN, cpu_count=4)),
        key(dict(ORIGIN, jax="0.10.3")),
        key(dict(ORIGIN, code_fingerprint="fedcba9876543210")),
        key(model="llama-tiny"),
        key(max_num_seqs=16),
        key(max_num_batched_tokens=128),
        key(page_size=32),
        key(max_model_len=512),
        key(dtype="bfloat16"),
    ]
    assert len({key(), *different}) == 1 + len(different)


def test_the_key_ignores_what_does_not_change_a_steps_time():
    """The policy and its options, the pool's size, the prefix cache: a zoo of policies calibrates once."""
    assert key(policy="mlfq", num_pages=192, enable_prefix_caching=True, preemption_mode="swap") == key()
    assert key(sim_step_time_scale=2.0) == key()


def test_the_code_fingerprint_follows_the_sources(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "step.py").write_text("x = 1\n")
    (tmp_path / "pkg" / "kernel.cc").write_text("int f();\n")
    sources = ("pkg", "one.py")

    def fingerprint():
        return provenance.code_fingerprint(tmp_path, sources)

    first = fingerprint()
    (tmp_path / "pkg" / "__pycache__").mkdir()
    (tmp_path / "pkg" / "__pycache__" / "step.cpython-311.pyc").write_bytes(b"\0")
    (tmp_path / "pkg" / "notes.txt").write_text("not code")
    assert fingerprint() == first
    seen = {first}
    for change in (
        lambda: (tmp_path / "pkg" / "step.py").write_text("x = 2\n"),
        lambda: (tmp_path / "pkg" / "kernel.cc").write_text("int g();\n"),
        lambda: (tmp_path / "one.py").write_text(""),  # a file that was missing appears
        lambda: (tmp_path / "pkg" / "new.h").write_text(""),
    ):
        change()
        seen.add(fingerprint())
    assert len(seen) == 5
    assert len(provenance.code_fingerprint()) == 16  # the real tree's sources are found


class CountingCalibration:
    """Stands in for cbjax.sim_calibration.calibrate: counts its calls, returns a known profile."""

    def __init__(self):
        self.calls = []

    def __call__(self, model, options, *, seed, scale):
        self.calls.append((model, options, seed, scale))
        fitted = CalibratedCost({16: 0.004, 64: 0.01}, {"num_seqs": 1e-4}, dict(total_rel_error=0.01))
        return sim_calibration.Calibration(fitted, [], [], {"decode": 0}, dict(options, num_pages=48))


@pytest.fixture
def counting(tmp_path, monkeypatch):
    monkeypatch.setenv(auto_profile.ENV_VAR, str(tmp_path / "profiles"))
    calibrate = CountingCalibration()
    monkeypatch.setattr(sim_calibration, "calibrate", calibrate)
    return calibrate


def decode_time(engine) -> float:
    engine.add_request("a", [5] * 10, SamplingParams(max_tokens=3, ignore_eos=True))
    list(engine.stream())
    return engine.clock.now()


def test_auto_calibrates_once_per_setup_and_reuses_the_cache(counting, tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        first = LLMEngine("test-tiny", policy="fcfs", **SIM)
    assert len(counting.calls) == 1 and "calibrating on the real engine" in caplog.text
    model, options, seed, scale = counting.calls[0]
    assert model == first.model_config  # the simulated model's shapes, the real engine's options for them
    assert options["max_num_seqs"] == 8 and options["num_pages"] == auto_profile.CALIBRATION_NUM_PAGES
    assert (seed, scale) == (auto_profile.SWEEP["seed"], auto_profile.SWEEP["scale"])
    (cached,) = (tmp_path / "profiles").glob("*.json")
    meta = json.loads(cached.read_text())["meta"]
    assert meta["origin"]["cpu_count"] and meta["setup_key"] == cached.stem and meta["calibration_s"] >= 0
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        again = LLMEngine("test-tiny", policy="mlfq", enable_prefix_caching=True, **SIM)
    assert len(counting.calls) == 1 and "reusing" in caplog.text
    assert decode_time(again) == decode_time(first) == pytest.approx(3 * (0.004 + 1e-4))
    LLMEngine("test-tiny", **{**SIM, "max_num_seqs": 16})  # another engine shape: its own calibration
    assert len(counting.calls) == 2 and len(list((tmp_path / "profiles").glob("*.json"))) == 2


def test_a_broken_cache_file_is_recalibrated(counting, tmp_path):
    LLMEngine("test-tiny", **SIM)
    (cached,) = (tmp_path / "profiles").glob("*.json")
    cached.write_text("{not json")
    LLMEngine("test-tiny", **SIM)
    assert len(counting.calls) == 2 and json.loads(cached.read_text())["kind"] == "calibrated"


def write_profile(path, meta) -> str:
    save_profile(CalibratedCost({16: 0.004}, {}), str(path), meta)
    return str(path)


@pytest.mark.parametrize(
    "change, reason",
    [
        (dict(cpu="Intel Xeon Platinum 8488C (family 6, model 143)"), "another CPU"),
        (dict(cpu_count=8), "another CPU count"),
        (dict(jax="0.9.0"), "another jax version"),
        (dict(code_fingerprint="0000000000000000"), "another version of the step's code"),
    ],
)
def test_a_profile_from_another_machine_or_tree_warns_why(tmp_path, caplog, change, reason):
    path = write_profile(tmp_path / "p.json", dict(origin=dict(ORIGIN, **change)))
    with caplog.at_level(logging.WARNING):
        reasons = provenance.check_origin(path, json.loads(pathlib.Path(path).read_text()), here=ORIGIN)
    assert len(reasons) == 1 and reasons[0].startswith(reason)
    assert reason in caplog.text and "use sim_profile='auto' or recalibrate" in caplog.text
    caplog.clear()
    same = write_profile(tmp_path / "same.json", dict(origin=ORIGIN))
    assert provenance.check_origin(same, json.loads(pathlib.Path(same).read_text()), here=ORIGIN) == []
    assert not caplog.text


def test_an_engine_loading_a_profile_without_origin_warns_it_cannot_be_checked(tmp_path, caplog):
    path = write_profile(tmp_path / "old.json", dict(model="llama-tiny", date="2026-12-01T18:15:29+00:00"))
    with caplog.at_level(logging.WARNING):
        LLMEngine("test-tiny", **{**SIM, "sim_profile": path})
    assert "records no origin" in caplog.text and "cannot be checked" in caplog.text and path in caplog.text
    caplog.clear()
    fresh = write_profile(tmp_path / "new.json", dict(origin=provenance.origin()))
    with caplog.at_level(logging.WARNING):  # made on this machine and tree: silent
        LLMEngine("test-tiny", **{**SIM, "sim_profile": fresh})
    assert not caplog.text


def test_predictions_and_hand_set_costs_are_not_checked(tmp_path, caplog):
    roofline = RooflineCost.for_model(get_model_config("llama-7b"), "h200")
    for name, cost in (("roofline", roofline), ("fixed", FixedCost(0.01))):
        save_profile(cost, str(tmp_path / f"{name}.json"))
        assert provenance.check_origin(name, json.loads((tmp_path / f"{name}.json").read_text())) == []
    assert not caplog.text


def test_auto_is_an_accepted_profile():
    config = EngineConfig.from_options(runner="sim", sim_profile=AUTO_PROFILE)
    assert config.sim.sim_profile == "auto"
    with pytest.raises(ValueError, match="both set"):
        EngineConfig.from_options(runner="sim", sim_profile=AUTO_PROFILE, sim_accelerator="h200")


def test_compare_policies_takes_auto_and_still_checks_a_path():
    from experiments import compare_policies as cp

    cfg = cp.resolve_config(parse(["--config.sim.profile=auto"], "configs/sim_zoo.py"))
    assert cp.engine_options(cfg, "fcfs")[1]["sim_profile"] == "auto"
    with pytest.raises(ValueError, match="cannot read the cost-model profile"):
        cp.resolve_config(parse([f"--config.sim.profile={ROOT}/no-such-profile.json"], "configs/sim_zoo.py"))
