"""The simulator: the engine's own Scheduler and policies driving a SimRunner whose step time comes from a cost
model (calibrated on this machine, or a roofline for a named accelerator). No jax. docs/sim.md.

A calibrated profile is one machine's, jax's and tree's: profiles record their origin (provenance.py), a simulation
that loads one made elsewhere warns, and sim_profile="auto" (auto_profile.py) calibrates on this machine once per
setup and reuses the cached profile. The sweep itself runs the real engine: cbjax/sim_calibration.py."""

from cbjax.sim.calibrated import CalibratedCost
from cbjax.sim.config import AUTO_PROFILE
from cbjax.sim.cost_model import (
    CostModel,
    FixedCost,
    ReplayCost,
    ScaledCost,
    cost_model_from_dict,
    engine_cost_model,
    load_profile,
    read_profile,
    save_profile,
)
from cbjax.sim.features import StepFeatures, step_features
from cbjax.sim.roofline import ACCELERATORS, RooflineCost
from cbjax.sim.sim_runner import SimRunner

__all__ = [
    "ACCELERATORS",
    "AUTO_PROFILE",
    "CalibratedCost",
    "CostModel",
    "FixedCost",
    "ReplayCost",
    "RooflineCost",
    "ScaledCost",
    "SimRunner",
    "StepFeatures",
    "cost_model_from_dict",
    "engine_cost_model",
    "load_profile",
    "read_profile",
    "save_profile",
    "step_features",
]
