"""Cost models: the time one step takes, from its features (cbjax.sim.features). Each is a small object with a
JSON profile (`to_dict` / `from_dict`); `load_profile` reads any of them back.

- FixedCost: every step costs the same (tests, back-of-envelope studies).
- ReplayCost: the i-th step costs the i-th recorded time (replaying a measured run step for step).
- CalibratedCost (cbjax.sim.calibrated): fitted to the real engine's measured steps.
- RooflineCost (cbjax.sim.roofline): a named accelerator's peak FLOP/s and HBM bandwidth; a prediction.
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


def cost_model_from_dict(d: dict) -> CostModel:
    from cbjax.sim.calibrated import CalibratedCost
    from cbjax.sim.roofline import RooflineCost

    kinds = {c.kind: c for c in (FixedCost, ReplayCost, CalibratedCost, RooflineCost)}
    kind = d.get("kind") if isinstance(d, dict) else None
    if kind not in kinds:
        raise ValueError(f"a cost-model profile needs 'kind' in {sorted(kinds)}, got {kind!r}")
    return kinds[kind].from_dict(d)


def load_profile(path: str) -> CostModel:
    """The cost model of a JSON profile file (written by `save_profile`, e.g. by experiments/calibrate.py)."""
    try:
        with open(path) as f:
            d = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read the cost-model profile {path}: {e}") from None
    return cost_model_from_dict(d)


def save_profile(model: CostModel, path: str, meta: dict | None = None) -> None:
    """Write `model` as a JSON profile, with `meta` (model, engine options, jax version, machine, date) under
    "meta"."""
    d = model.to_dict()
    if meta:
        d["meta"] = meta
    with open(path, "w") as f:
        json.dump(d, f, indent=1, sort_keys=True)
        f.write("\n")
