"""The real engine's steps as the simulator's cost models see them: features and measured seconds, step by step
(shared by experiments/calibrate.py, experiments/sim_fidelity.py and experiments/fidelity_study.py). `measure`
lives in cbjax/sim_calibration.py, where sim_profile="auto" calibrates with it; it is re-exported here."""

from cbjax.sim_calibration import measure

__all__ = ["measure", "write_steps"]


def write_steps(path: str, groups: dict[str, tuple[list, list]]) -> None:
    """Write measured steps as JSONL, one line per step: {"sweep": group name, "seconds": ..., features...}."""
    import json

    with open(path, "w") as f:
        for name, (feats, times) in groups.items():
            for ft, t in zip(feats, times, strict=True):
                f.write(json.dumps({"sweep": name, "seconds": t, **ft.as_dict()}) + "\n")
