"""SimConfig: which runner serves the engine's steps, and for the simulator, where its step times come from."""

import dataclasses

from cbjax.config import validation as check
from cbjax.config.section import Section
from cbjax.sim.roofline import ACCELERATORS

# "model": the real model on this machine. "sim": the simulator (docs/sim.md): the same scheduler and policies, step
# times from a cost model, a virtual clock, no weights and no compile.
RUNNERS = ("model", "sim")
# sim_profile="auto": a profile calibrated on this machine for this model and engine shape, cached and reused
# (cbjax/sim/auto_profile.py); the first simulation of a setup runs the calibration sweep on the real engine.
AUTO_PROFILE = "auto"


@dataclasses.dataclass(frozen=True)
class SimConfig(Section):
    runner: str = "model"  # one of RUNNERS
    sim_profile: str | None = None  # sim: a cost-model profile (JSON, e.g. from experiments/calibrate.py) or "auto"
    sim_accelerator: str | None = None  # sim without a profile: the roofline of this accelerator (cbjax.sim.roofline)
    sim_num_chips: int = 1  # sim_accelerator: chips in tensor parallel (communication taken as free)
    # sim: every step's time times this (cbjax.sim.ScaledCost): a slower (> 1) or faster machine, or how much a
    # result moves with the cost model's error.
    sim_step_time_scale: float = 1.0

    def checked(self) -> dict:
        values = dict(
            runner=check.choice("runner", self.runner, RUNNERS),
            sim_profile=None if self.sim_profile is None else check.text("sim_profile", self.sim_profile),
            sim_accelerator=check.choice("sim_accelerator", self.sim_accelerator, (None, *ACCELERATORS)),
            sim_num_chips=check.integer("sim_num_chips", self.sim_num_chips, 1),
            sim_step_time_scale=check.real("sim_step_time_scale", self.sim_step_time_scale, 0.0, low_open=True),
        )
        if values["sim_profile"] is not None and values["sim_accelerator"] is not None:
            raise ValueError(
                f"sim_profile ({self.sim_profile!r}) and sim_accelerator ({self.sim_accelerator!r}) both set; "
                "a simulation takes its step times from one of them"
            )
        return values

    @property
    def enabled(self) -> bool:
        return self.runner == "sim"
