"""Calibrating the simulator on this machine: a sweep of synthetic workloads on the real engine, every step's
features and measured time, and the CalibratedCost fitted to them.

Used by sim_profile="auto" (cbjax/sim/auto_profile.py, through cbjax/engine_build.py), experiments/calibrate.py
(which writes a profile file) and experiments/sim_fidelity.py (calibration rounds between real runs). It drives
the real engine and the online loop, so it sits beside engine_build rather than in cbjax/sim, which imports only
core and config and never jax (tests/test_layout.py); its imports of the engine are inside the functions, as
engine_build imports this module.

A step's time is what cbjax.bench.online moves a virtual clock by for the real engine (the wall time of the
engine's step call up to the fetch of its results), so the simulator advances its clock the same way. The sweep:
  decode  N sequences (1 .. max_num_seqs) with contexts of C tokens (16 .. 512), 48 decode steps each
  prefill prompts long enough to fill every token bucket (chunked under the budget), few output tokens
  batch   full batches of random-length requests, all at once (many sequences decoding, prompts joining)
  mixed   Poisson arrivals of random-length requests (prefill chunks and decodes in the same step)
  swap    40 of those requests into a small KV pool with preemption by swap (the cost per byte copied)
"""

import dataclasses
import logging

_log = logging.getLogger(__name__)


@dataclasses.dataclass
class Calibration:
    model: object  # cbjax.sim.CalibratedCost
    features: list
    times: list[float]
    steps_per_sweep: dict[str, int]
    swap_engine_options: dict

    def groups(self) -> dict[str, tuple[list, list]]:
        """sweep name -> (its steps' features, their measured seconds)."""
        out, i = {}, 0
        for name, n in self.steps_per_sweep.items():
            out[name] = (self.features[i : i + n], self.times[i : i + n])
            i += n
        return out


def sweep_workloads(vocab_size: int, max_num_seqs: int, max_model_len: int, seed: int, scale: float) -> dict:
    """name -> workload (cbjax.bench.workload requests). `scale` multiplies the number of requests of every sweep
    but the decode groups (which are set by max_num_seqs)."""
    import numpy as np

    from cbjax.bench.requests import WorkloadRequest
    from cbjax.bench.workload import make_workload

    rng = np.random.default_rng(seed)
    k = scale
    out = {}
    decode = []
    for n in sorted({1, 2, 4, 8, 16, max_num_seqs}):
        for ctx in (16, 128, 512):
            for i in range(n):
                prompt = tuple(int(x) for x in rng.integers(3, vocab_size, ctx))
                decode.append(WorkloadRequest(f"d{n}-{ctx}-{i}", 0.0, prompt, 48))
    # Offline groups run one after another (each group's arrival waits for the previous to drain).
    out["decode"] = decode
    out["prefill"] = make_workload(
        dict(kind="synthetic", num_requests=max(4, int(24 * k)), seed=seed, arrival="offline",
             prompt_len=dict(dist="uniform", low=64, high=max_model_len - 8), output_len=2, vocab_size=vocab_size)
    )  # fmt: skip
    out["batch"] = make_workload(
        dict(kind="synthetic", num_requests=max(32, int(128 * k)), seed=seed + 2, arrival="offline",
             prompt_len=dict(dist="uniform", low=8, high=400), output_len=dict(dist="uniform", low=16, high=300),
             vocab_size=vocab_size)
    )  # fmt: skip
    out["mixed"] = make_workload(
        dict(kind="synthetic", num_requests=max(20, int(200 * k)), seed=seed + 1, arrival="poisson",
             request_rate=30.0, prompt_len=dict(dist="uniform", low=8, high=600),
             output_len=dict(dist="uniform", low=4, high=200), vocab_size=vocab_size)
    )  # fmt: skip
    return out


def measure(engine, workload) -> tuple[list, list, object]:
    """Run `workload` on `engine` (on a virtual clock, measured step times); returns each step's features and
    measured seconds, in the order the steps finished, and run_online's result."""
    from cbjax.bench.online import run_online
    from cbjax.model.llama import kv_cache_bytes_per_page
    from cbjax.sim import step_features

    page_bytes = kv_cache_bytes_per_page(engine.model_config, engine.config.cache.page_size)
    feats, times = [], []
    runner, clock = engine.runner, engine.clock
    fetch, advance = runner.fetch, clock.advance

    def recording_fetch(handle):
        feats.append(step_features(handle.out, handle.padded_tokens, page_bytes))
        return fetch(handle)

    def recording_advance(dt):
        times.append(dt)
        advance(dt)

    runner.fetch, clock.advance = recording_fetch, recording_advance
    try:
        result = run_online(engine, workload)
    finally:
        del runner.fetch, clock.advance
    if len(feats) != len(times):
        raise RuntimeError(f"{len(feats)} steps fetched but {len(times)} clock moves")
    return feats, times, result


def calibrate(model, opts: dict, *, seed: int, scale: float, log=_log.info) -> Calibration:
    """Run the sweep on the real engine for `model` (a name, a ModelConfig or a checkpoint, as LLMEngine takes it;
    `opts`: LLMEngine options) and fit a CalibratedCost to its steps."""
    from cbjax.core.clock import VirtualClock
    from cbjax.engine import LLMEngine
    from cbjax.sim import CalibratedCost

    engine = LLMEngine(model, clock=VirtualClock(), **opts)
    engine.wait_until_warm()
    feats, times, counts = [], [], {}
    cfg = engine.config
    workloads = sweep_workloads(
        engine.model_config.vocab_size, cfg.scheduler.max_num_seqs, cfg.scheduler.max_model_len, seed, scale
    )
    for name, wl in workloads.items():
        f, t, _ = measure(engine, wl)
        feats += f
        times += t
        counts[name] = len(f)
        log(f"{name}: {len(f)} steps, {sum(t):.2f} s measured")
    del engine
    # Swaps: a pool small enough that the mix preempts (its own engine: a different KV shape).
    swap_opts = dict(opts, num_pages=48, watermark_fraction=0.0, preemption_mode="swap", swap_space_gib=0.25)
    swapper = LLMEngine(model, clock=VirtualClock(), **swap_opts)
    swapper.wait_until_warm()
    # A few requests: a small pool thrashes for many steps, which would outweigh the other sweeps in the fit.
    f, t, _ = measure(swapper, workloads["mixed"][:40])
    feats += f
    times += t
    counts["swap"] = len(f)
    log(f"swap: {len(f)} steps ({sum(x.swap_bytes > 0 for x in f)} with swaps), {sum(t):.2f} s measured")
    fitted = CalibratedCost.fit(feats, times)
    i = 0
    for name, n in counts.items():  # how well one model fits each sweep's total time
        pred = sum(map(fitted.step_time, feats[i : i + n]))
        log(f"  {name}: predicted / measured total {pred / sum(times[i : i + n]) - 1:+.1%}")
        i += n
    return Calibration(fitted, feats, times, counts, swap_opts)
