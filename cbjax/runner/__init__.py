"""The runner room: StepInput packing, the jitted step, on-device sampling."""
