"""sim_profile="auto": a profile calibrated on this machine for this setup, made once and then reused from a cache.

The first simulation of a setup runs the calibration sweep on the real engine (cbjax/sim_calibration.py, 40-60 s
on 2 CPU cores at load ~2 with jax's compilation cache warm, 2-2.5 minutes cold or loaded) and writes the profile
to the cache; every later one with the same key reads it back. The key hashes everything that sets a step's
measured time:

- the origin (cbjax/sim/provenance.py): CPU model and count, jax and jaxlib versions, accelerator plugins,
  JAX_PLATFORMS, and the fingerprint of the step's code, so an edit to the runner, model or kernels recalibrates;
- the model's shapes and dtypes (every ModelConfig field);
- the engine options that change the real step program or its host work (CALIBRATION_OPTIONS); the scheduling
  policy and its options do not (a zoo of 13 policies calibrates once);
- the sweep's own parameters (SWEEP).

Left out on purpose: the KV pool's size. A step reads only the pages in its page tables, and side-by-side timings
of 1-2 sequence decode steps on a 1024-page and a 48-page engine differed by less than the machine's drift
(docs/sim.md); the sweep needs room (decode groups of up to 32 sequences of 512-token prompts, each group's
sequences all at once; full offline batches) that a small simulated pool would turn into thousands of
preemptions. The calibration engine gets CALIBRATION_NUM_PAGES, as experiments/calibrate.py.

The cache: $CBJAX_SIM_PROFILE_CACHE if set, else $XDG_CACHE_HOME/cbjax/sim-profiles, else
~/.cache/cbjax/sim-profiles; one <key>.json per setup, an ordinary profile (load_profile reads it) whose meta
records the key's parts.
"""

import dataclasses
import datetime
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable

from cbjax.sim import provenance

_log = logging.getLogger(__name__)

ENV_VAR = "CBJAX_SIM_PROFILE_CACHE"
# The step-time-relevant engine options (flat names, EngineConfig.options()).
CALIBRATION_OPTIONS = (
    "max_num_seqs",  # the slot count: the step's padded shapes
    "max_num_batched_tokens",  # the token buckets
    "max_model_len",  # pages per sequence: the page tables' width
    "page_size",
    "kv_cache_dtype",
    "async_scheduling",  # whether the host's packing overlaps the step
    "num_scheduler_steps",
    "dtype",
    "matmul_dtype",
    "quantization",
    "cpu_matmul",
    "tensor_parallel_size",
    "attention_backend",
    "pallas_interpret",
)
CALIBRATION_NUM_PAGES = 1024  # the calibration engine's KV pool (16k tokens of 16): the sweep's decode groups fit
# Scale 1.0: at 0.1, 0.3 and 0.5 the sweep put fewer than 10 steps in some of buckets 64-128 and the fits came out
# with negative intercepts for some buckets of 96-256 tokens (the shared per-token coefficients took their cost);
# at 1.0 they rose with the bucket in every sitting (docs/sim.md, "Profiles"). 40-60 s on 2 cores at load ~2.
SWEEP = dict(seed=1234, scale=1.0)


def cache_dir() -> str:
    """Where auto profiles are kept ($CBJAX_SIM_PROFILE_CACHE, else the user's cache folder)."""
    if os.environ.get(ENV_VAR):
        return os.path.abspath(os.path.expanduser(os.environ[ENV_VAR]))
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "cbjax", "sim-profiles")


def calibration_options(config) -> dict:
    """The engine options of `config` (an EngineConfig) that the calibration engine takes over: CALIBRATION_OPTIONS,
    the rest at the calibration's own values."""
    options = config.options()
    return {k: options[k] for k in CALIBRATION_OPTIONS}


def setup_of(config, mcfg, origin: dict) -> dict:
    """Everything the key hashes: `origin` (provenance.origin()), the model config `mcfg`, the engine options
    that set a step's time, the sweep."""
    model = {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(mcfg).items()}
    return dict(origin=origin, model=model, engine=calibration_options(config), sweep=dict(SWEEP))


def setup_key(setup: dict) -> str:
    """A short stable hash of `setup` (its JSON with sorted keys)."""
    text = json.dumps(setup, sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


_reported: set[str] = set()  # a zoo builds one engine per policy: say "reusing" once per process and file


def auto_profile(config, mcfg, calibrate: Callable, *, origin: dict | None = None) -> dict:
    """The profile (as a dict; cost_model_from_dict builds it) for an engine with `config` (an EngineConfig) and
    model `mcfg`: read from the cache when one with this setup's key is there, else calibrated now with
    `calibrate(mcfg, options, seed=, scale=)` (cbjax.sim_calibration.calibrate: returns a Calibration) and cached.
    `origin` is provenance.origin() unless given (tests)."""
    setup = setup_of(config, mcfg, provenance.origin() if origin is None else origin)
    key = setup_key(setup)
    path = os.path.join(cache_dir(), f"{key}.json")
    cached = read_cached(path, key)
    if cached is not None:
        if path not in _reported:
            _reported.add(path)
            meta = cached["meta"]
            _log.warning("sim_profile='auto': reusing %s, calibrated on this machine and tree on %s (%.0f s then)",
                         path, meta.get("date"), meta.get("calibration_s", float("nan")))  # fmt: skip
        return cached
    options = dict(setup["engine"], num_pages=CALIBRATION_NUM_PAGES, warmup=True)
    _log.warning(
        "sim_profile='auto': no cached profile for this machine, jax, code and engine shape (key %s); calibrating "
        "on the real engine now (about 1-2 minutes; keep the machine otherwise idle). It will be cached in %s",
        key,
        path,
    )
    load_before, start, t0 = list(os.getloadavg()), datetime.datetime.now().astimezone(), time.perf_counter()
    cal = calibrate(mcfg, options, **SWEEP)
    seconds = time.perf_counter() - t0
    profile = cal.model.to_dict()
    profile["meta"] = dict(
        setup_key=key,
        origin=setup["origin"],
        model=setup["model"],
        engine_options=options,
        swap_engine_options=cal.swap_engine_options,
        sweep=setup["sweep"],
        steps_per_sweep=cal.steps_per_sweep,
        date=start.isoformat(timespec="seconds"),
        calibration_s=seconds,
        load_average_before=load_before,
        load_average_after=list(os.getloadavg()),
        command="engine option sim_profile='auto' (cbjax/sim/auto_profile.py)",
    )
    write_atomically(path, profile)
    fit = profile.get("fit") or {}
    _log.warning(
        "sim_profile='auto': calibrated in %.0f s at load average %.1f -> %.1f on %s CPUs (the fit's total time "
        "error %+.1f%% over %s steps); cached in %s",
        seconds,
        load_before[0],
        profile["meta"]["load_average_after"][0],
        setup["origin"].get("cpu_count"),
        100 * fit.get("total_rel_error", float("nan")),
        fit.get("num_steps", "?"),
        path,
    )
    cpus = setup["origin"].get("cpu_count") or 1
    if max(load_before[0], profile["meta"]["load_average_after"][0]) > cpus:
        # More runnable threads than cores: the steps were measured sharing the cores, and the cache keeps them.
        _log.warning("sim_profile='auto': the machine was busy while calibrating (load average above its %s CPUs), so "
                     "these step times include other jobs' contention; delete %s to calibrate again when it is quiet",
                     cpus, path)  # fmt: skip
    return profile


def read_cached(path: str, key: str) -> dict | None:
    """The cached profile at `path` if it is readable and was made for `key`, else None (calibrate again)."""
    try:
        with open(path) as f:
            d = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, json.JSONDecodeError) as e:
        _log.warning("sim_profile='auto': cannot read the cached profile %s (%s); calibrating again", path, e)
        return None
    if not isinstance(d, dict) or (d.get("meta") or {}).get("setup_key") != key:
        _log.warning("sim_profile='auto': %s is not a profile for key %s; calibrating again", path, key)
        return None
    return d


def write_atomically(path: str, profile: dict) -> None:
    """Write `profile` as JSON at `path` through a temporary file, so a reader (another process simulating the same
    setup) never sees half a file."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(profile, f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)
