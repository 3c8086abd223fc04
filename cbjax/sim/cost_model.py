"""Cost models: the time one step takes, from its features (cbjax.sim.features). Each is a small object with a
JSON profile (`to_dict` / `from_dict`); `load_profile` reads any of them back.

- FixedCost: every step costs the same (tests, back-of-envelope studies).
- ReplayCost: the i-th step costs the i-th recorded time (replaying a measured run step for step).
- CalibratedCost (cbjax.sim.calibrated): fitted to the real engine's measured steps.
- RooflineCost (cbjax.sim.roofline): a named accelerator's peak FLOP/s and HBM bandwidth; a prediction.
- ScaledCost: another cost model's times times a factor (a slower or faster machine; how much a result moves
  with the cost model's error).
"""

import json
from collections.abc import Sequence
from typing import Protocol

from cbjax.sim.features import StepFeatures


class CostModel(Protocol):
    kind: str

    def step_time(self, f: StepFeatures) -> float:
        """Seconds the step takes: what the virtual clock advances by."""
        ...

    def to_dict(self) -> dict: ...


class FixedCost:
    """Every step (swap-only steps included) takes `seconds`."""

    kind = "fixed"

    def __init__(self, seconds: float):
        if not seconds > 0:
            raise ValueError(f"FixedCost needs seconds > 0, got {seconds}")
        self.seconds = float(seconds)

    def step_time(self, f: StepFeatures) -> float:
        return self.seconds

    def to_dict(self) -> dict:
        return {"kind": self.kind, "seconds": self.seconds}

    @classmethod
    def from_dict(cls, d: dict) -> "FixedCost":
        return cls(d["seconds"])


class ReplayCost:
    """The i-th step the runner executes takes `times[i]`; running past the end is an error (the replay and the
    recorded run took different paths)."""

    kind = "replay"

    def __init__(self, times: Sequence[float]):
        self.times = [float(t) for t in times]
        self.num_used = 0

    def step_time(self, f: StepFeatures) -> float:
        if self.num_used >= len(self.times):
            raise RuntimeError(f"ReplayCost: step {self.num_used + 1} asked for, only {len(self.times)} recorded")
        t = self.times[self.num_used]
        self.num_used += 1
        return t

    def to_dict(self) -> dict:
        return {"kind": self.kind, "times": self.times}

    @classmethod
    def from_dict(cls, d: dict) -> "ReplayCost":
        return cls(d["times"])


class ScaledCost:
    """`base`'s step time times `factor`: the same machine `factor` times slower (> 1) or faster (< 1) on every
    step. What-if studies, and the sensitivity of a simulated figure to the cost model's error
    (experiments/sim_fidelity.py)."""

    kind = "scaled"

    def __init__(self, base: CostModel, factor: float):
        if not factor > 0:
            raise ValueError(f"ScaledCost needs factor > 0, got {factor}")
        self.base, self.factor = base, float(factor)
        if hasattr(base, "kv_pages"):
            # A roofline's KV memory (its HBM after the weights): scaling time does not change it. The engine asks
            # hasattr(cost_model, "kv_pages"), so it is there only where the base has it.
            self.kv_pages = base.kv_pages

    def step_time(self, f: StepFeatures) -> float:
        return self.factor * self.base.step_time(f)

    def to_dict(self) -> dict:
        return {"kind": self.kind, "factor": self.factor, "base": self.base.to_dict()}

    @classmethod
    def from_dict(cls, d: dict) -> "ScaledCost":
        return cls(cost_model_from_dict(d["base"]), d["factor"])


def cost_model_from_dict(d: dict) -> CostModel:
    from cbjax.sim.calibrated import CalibratedCost
    from cbjax.sim.roofline import RooflineCost

    kinds = {c.kind: c for c in (FixedCost, ReplayCost, CalibratedCost, RooflineCost, ScaledCost)}
    kind = d.get("kind") if isinstance(d, dict) else None
    if kind not in kinds:
        raise ValueError(f"a cost-model profile needs 'kind' in {sorted(kinds)}, got {kind!r}")
    return kinds[kind].from_dict(d)


def read_profile(path: str) -> dict:
    """A JSON profile file as a dict (ValueError if it cannot be read)."""
    try:
        with open(path) as f:
            d = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read the cost-model profile {path}: {e}") from None
    return d


def load_profile(path: str) -> CostModel:
    """The cost model of a JSON profile file (written by `save_profile`, e.g. by experiments/calibrate.py)."""
    return cost_model_from_dict(read_profile(path))


def save_profile(model: CostModel, path: str, meta: dict | None = None) -> None:
    """Write `model` as a JSON profile, with `meta` (model, engine options, jax version, machine, date) under
    "meta"."""
    d = model.to_dict()
    if meta:
        d["meta"] = meta
    with open(path, "w") as f:
        json.dump(d, f, indent=1, sort_keys=True)
        f.write("\n")


def engine_cost_model(config, mcfg, given: CostModel | None = None, calibrate=None) -> CostModel:
    """The cost model of a simulating engine with `config` (an EngineConfig) and model shapes `mcfg`: `given`,
    else its sim_profile (a file, whose origin is checked against this machine and tree, or "auto": this machine's
    cached calibration, made now with `calibrate` if there is none: cbjax/sim/auto_profile.py), else its
    sim_accelerator's roofline; times its sim_step_time_scale."""
    from cbjax.sim.auto_profile import auto_profile
    from cbjax.sim.config import AUTO_PROFILE
    from cbjax.sim.provenance import check_origin
    from cbjax.sim.roofline import RooflineCost

    cfg = config.sim
    if given is not None:
        cost = given
    elif cfg.sim_profile == AUTO_PROFILE:
        if calibrate is None:
            raise ValueError("sim_profile='auto' needs a calibration function (LLMEngine passes the real engine's)")
        cost = cost_model_from_dict(auto_profile(config, mcfg, calibrate))
    elif cfg.sim_profile is not None:
        d = read_profile(cfg.sim_profile)
        cost = cost_model_from_dict(d)
        check_origin(cfg.sim_profile, d)
    elif cfg.sim_accelerator is not None:
        cost = RooflineCost.for_model(
            mcfg, cfg.sim_accelerator, num_chips=cfg.sim_num_chips, kv_cache_dtype=config.cache.kv_cache_dtype
        )
    else:
        raise ValueError("runner='sim' needs sim_profile (a cost-model profile or 'auto') or sim_accelerator")
    return cost if cfg.sim_step_time_scale == 1.0 else ScaledCost(cost, cfg.sim_step_time_scale)
