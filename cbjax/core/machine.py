"""The machine a figure was measured on, for provenance: shared by the experiment room (cbjax/bench) and the
simulator's profiles (cbjax/sim), which may both import core. Pure Python."""

import platform


def cpu_model(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The processor's name and family/model numbers as the OS reports them ("AMD EPYC (family 26, model 2)"),
    for provenance: figures measured on one CPU say little about another, and a shared VM may land on a different
    one between sittings. Falls back to `platform.processor()` / `platform.machine()` where /proc/cpuinfo is missing."""
    fields: dict[str, str] = {}
    try:
        with open(cpuinfo) as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "cpu family", "model") and key not in fields:
                    fields[key] = value.strip()
                elif not key:  # the first processor's block ends
                    break
    except OSError:
        pass
    name = fields.get("model name") or platform.processor() or platform.machine()
    if "cpu family" in fields and "model" in fields:  # "AMD EPYC" alone does not tell Zen 4 from Zen 5
        name += f" (family {fields['cpu family']}, model {fields['model']})"
    return name
