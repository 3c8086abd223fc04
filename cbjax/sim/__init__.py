"""The simulator: the engine's own Scheduler and policies driving a SimRunner whose step time comes from a cost
model (calibrated on this machine, or a roofline for a named accelerator). No jax. docs/sim.md."""

from cbjax.sim.calibrated import CalibratedCost
from cbjax.sim.cost_model import (
    CostModel,
    FixedCost,
    ReplayCost,
    ScaledCost,
    cost_model_from_dict,
    engine_cost_model,
    load_profile,
    save_profile,
)
from cbjax.sim.features import StepFeatures, step_features
from cbjax.sim.roofline import ACCELERATORS, RooflineCost
from cbjax.sim.sim_runner import SimRunner

__all__ = [
    "ACCELERATORS",
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
    "save_profile",
    "step_features",
]
