"""Where a calibrated profile comes from: the machine, the jax version and the code it was measured with (its
"origin", recorded under a profile's meta), and the warning when a profile given by path was made elsewhere.

A calibrated profile's step times are one machine's, with one jax and one version of the step's code: the VM this
project runs on moved between CPUs twice in two days, and the committed llama-tiny profile ended up 4x slower than
the engine it was supposed to stand for (docs/sim.md, "No stale profile"). So every calibration records its origin,
and loading a profile for a simulation compares that origin with this process's and says which part differs.

The code fingerprint hashes the sources that decide how long a real step takes (FINGERPRINT_SOURCES): the model
runner (packing, the jitted step, sampling), the model, the kernels (their C++ too), the engine's step loop, and the
sweep and fit that turn measured steps into a profile. The scheduler (cbjax/core) is left out on purpose: its host
time is a small part of a step, and with it every policy change would invalidate every profile.

No jax import: versions come from the installed distributions' metadata, sources are read as files.
"""

import hashlib
import importlib.metadata
import logging
import os
import pathlib

from cbjax.core.machine import cpu_model

_log = logging.getLogger(__name__)

# The repository (or site-packages) folder that holds cbjax/ and kernels_pallas/.
ROOT = pathlib.Path(__file__).resolve().parents[2]
FINGERPRINT_SOURCES = (
    "cbjax/runner",
    "cbjax/model",
    "kernels_pallas",
    "cbjax/engine.py",
    "cbjax/sim_calibration.py",
    "cbjax/sim/calibrated.py",
    "cbjax/sim/features.py",
)
SOURCE_SUFFIXES = (".py", ".cc", ".cpp", ".c", ".h")
# Distributions whose presence moves jax's steps to an accelerator (or changes which one).
ACCELERATOR_PACKAGES = ("jax-cuda12-plugin", "jax-cuda13-plugin", "jax-rocm60-plugin", "libtpu", "libtpu-nightly")
# Origin fields a profile is checked on, and what a difference in each means.
CHECKED = {
    "cpu": "another CPU",
    "cpu_count": "another CPU count",
    "jax": "another jax version",
    "jaxlib": "another jaxlib version",
    "accelerator_packages": "other accelerator plugins",
    "jax_platforms": "another JAX_PLATFORMS",
    "code_fingerprint": "another version of the step's code (" + ", ".join(FINGERPRINT_SOURCES) + ")",
}
ADVICE = "step times may not match this machine/tree; use sim_profile='auto' or recalibrate (experiments/calibrate.py)"


def code_fingerprint(root: pathlib.Path = ROOT, sources: tuple[str, ...] = FINGERPRINT_SOURCES) -> str:
    """A hash of the source files under `sources` (paths relative to `root`; folders recursively): names and
    contents, so an edit, a new file or a removed one changes it."""
    h = hashlib.sha256()
    for rel in sources:
        path = pathlib.Path(root, rel)
        if path.is_dir():
            files = sorted(p for p in path.rglob("*") if p.suffix in SOURCE_SUFFIXES and "__pycache__" not in p.parts)
        else:
            files = [path] if path.is_file() else []
        h.update(f"{rel}:{len(files)}\0".encode())
        for p in files:
            h.update(p.relative_to(root).as_posix().encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def origin() -> dict:
    """This process's machine, jax and code, as a profile records them (meta["origin"])."""
    return dict(
        cpu=cpu_model(),
        cpu_count=os.cpu_count(),
        jax=_version("jax"),
        jaxlib=_version("jaxlib"),
        accelerator_packages={p: v for p in ACCELERATOR_PACKAGES if (v := _version(p)) is not None},
        jax_platforms=os.environ.get("JAX_PLATFORMS", ""),
        code_fingerprint=code_fingerprint(),
    )


def origin_differences(recorded: dict, here: dict) -> list[str]:
    """What differs between a profile's recorded origin and `here`, one phrase per checked field."""
    out = []
    for field, meaning in CHECKED.items():
        if recorded.get(field) != here.get(field):
            out.append(f"{meaning}: made with {recorded.get(field)!r}, here {here.get(field)!r}")
    return out


def is_measured(profile: dict) -> bool:
    """Whether a profile's step times were measured on a machine (a calibration, a replay), not derived from a
    data sheet (a roofline) or set by hand (fixed)."""
    kind = profile.get("kind")
    if kind == "scaled":
        return is_measured(profile.get("base") or {})
    return kind in ("calibrated", "replay")


_warned: set[tuple[str, tuple[str, ...]]] = set()  # a zoo builds one engine per policy: warn once per process


def check_origin(path: str, profile: dict, here: dict | None = None) -> list[str]:
    """Warn (once per process and path) when the measured profile `profile`, read from `path`, was made on another
    machine, with another jax or by another version of the step's code, or records no origin at all. Returns the
    reasons (empty: it matches, or its step times are not measured)."""
    if not is_measured(profile):
        return []
    recorded = (profile.get("meta") or {}).get("origin")
    if not isinstance(recorded, dict):
        reasons = ["it records no origin (machine, jax version, code fingerprint), so it cannot be checked"]
    else:
        reasons = origin_differences(recorded, origin() if here is None else here)
    if reasons and (path, tuple(reasons)) not in _warned:
        _warned.add((path, tuple(reasons)))
        date = (profile.get("meta") or {}).get("date", "an unknown date")
        _log.warning("cost-model profile %s (made %s): %s; %s", path, date, "; ".join(reasons), ADVICE)
    return reasons
