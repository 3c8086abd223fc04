"""Calibrating the simulator on this machine: a sweep of synthetic workloads on the real engine, every step's
features and measured time, and the CalibratedCost fitted to them.

Used by sim_profile="auto" (cbjax/sim/auto_profile.py, through cbjax/engine_build.py), experiments/calibrate.py
(which writes a profile file) and experiments/sim_fidelity.py (calibration rounds between real runs). It drives
the real engine and the online loop, so it sits beside engine_build rather than in cbjax/sim, which imports only
core and config and never jax (tests/test_layout.py); its imports of the engine are inside the functions, as
engine_build imports this module.

A step's time is what cbjax.bench.online moves a virtual clock by for the real engine (the wall time of the
engine's step call up to the fetch of its results), so the simulator advances its clock the same way. The sweep:
  decode  N sequences (every size of DECODE_SIZES up to max_num_seqs) with prompts of C tokens (DECODE_CONTEXTS),
          each group its own run on the empty engine: once its prompts are in, DECODE_STEPS decode steps of exactly
          N sequences, nothing else in the step and nothing queued (groups that do not fit the pool are left out)
  prefill prompts long enough to fill every token bucket (chunked under the budget), few output tokens
  batch   full batches of random-length requests, all at once (many sequences decoding, prompts joining)
  mixed   Poisson arrivals of random-length requests (prefill chunks and decodes in the same step)
  swap    40 of those requests into a small KV pool with preemption by swap (the cost per byte copied)

The speed probe (`probe_speed`): a few seconds of fixed steps (three decode groups and a prefill run) timed on a warm
real engine and compared with a profile's predictions of the same steps. Their ratio is the machine's speed at that
minute relative to the minutes the profile was calibrated in: a shared machine drifts 10-40% within an hour, and a
profile calibrated in a slow minute overpredicted every workload of a study an hour later by about 10%
(docs/sim.md, fidelity). The simulator takes the ratio as sim_step_time_scale.
"""

import dataclasses
import logging

_log = logging.getLogger(__name__)

# The decode groups. Until 2026-12-04 they were 1, 2, 4, 8, 16 and 32 sequences at 16, 128 and 512 tokens, all
# arriving at once: 189 requests in a 32-slot engine, so nearly every decode step held 32 sequences of mixed
# contexts beside a waiting queue, and decode steps of 5-16 sequences (the bulk of a workload near saturation)
# were seen only in the drain; the fit overpredicted them by 26% there (docs/sim.md, fidelity).
DECODE_SIZES = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, 24, 28, 32)
DECODE_CONTEXTS = (16, 128, 512)  # prompt tokens: short chats to long documents (at 1/8 lengths)
DECODE_STEPS = 32  # output tokens per request: that many decode steps per group, contexts growing by as much


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


def sweep_workloads(
    vocab_size: int,
    max_num_seqs: int,
    max_model_len: int,
    seed: int,
    scale: float,
    token_budget: int = 256,
    kv_tokens: int | None = None,
) -> dict:
    """name -> its runs, each a workload (cbjax.bench.workload requests) run on its own; every sweep is one run
    but the decode groups (one run per group). `scale` multiplies the number of requests of every sweep but the
    decode groups (which are set by max_num_seqs). `token_budget`: the engine's max_num_batched_tokens; `kv_tokens`:
    its KV pool in tokens (a decode group that would not fit in 90% of it is left out)."""
    import numpy as np

    from cbjax.bench.requests import WorkloadRequest
    from cbjax.bench.workload import make_workload

    rng = np.random.default_rng(seed)
    k = scale
    out = {}
    groups = []
    for ctx in DECODE_CONTEXTS:
        for n in (*(x for x in DECODE_SIZES if x < max_num_seqs), max_num_seqs):
            # The prompts are prefilled in chunks under the budget (what the decodes leave of it; the last chunk
            # samples the first token); the first ones decode meanwhile, so each gets as many more tokens as that
            # takes, and all n then decode together for DECODE_STEPS steps.
            fill_steps = -(-n * ctx // max(token_budget - n, 1))
            out_len = min(DECODE_STEPS + 1 + fill_steps, max_model_len - ctx)
            if kv_tokens is not None and n * (ctx + out_len) > 0.9 * kv_tokens:
                continue  # (all n sequences must fit at once, or the group's steps hold fewer)
            prompts = [tuple(int(x) for x in rng.integers(3, vocab_size, ctx)) for _ in range(n)]
            groups.append([WorkloadRequest(f"d{n}-{ctx}-{i}", 0.0, p, out_len) for i, p in enumerate(prompts)])
    out["decode"] = groups
    out["prefill"] = [make_workload(
        dict(kind="synthetic", num_requests=max(4, int(24 * k)), seed=seed, arrival="offline",
             prompt_len=dict(dist="uniform", low=64, high=max_model_len - 8), output_len=2, vocab_size=vocab_size)
    )]  # fmt: skip
    out["batch"] = [make_workload(
        dict(kind="synthetic", num_requests=max(32, int(128 * k)), seed=seed + 2, arrival="offline",
             prompt_len=dict(dist="uniform", low=8, high=400), output_len=dict(dist="uniform", low=16, high=300),
             vocab_size=vocab_size)
    )]  # fmt: skip
    out["mixed"] = [make_workload(
        dict(kind="synthetic", num_requests=max(20, int(200 * k)), seed=seed + 1, arrival="poisson",
             request_rate=30.0, prompt_len=dict(dist="uniform", low=8, high=600),
             output_len=dict(dist="uniform", low=4, high=200), vocab_size=vocab_size)
    )]  # fmt: skip
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


# The probe's steps: decode groups of 4, 12 and 32 sequences at 128-token prompts (the decode batches of a workload
# below and at saturation) and a prefill run of 4 prompts of 200-300 tokens (full token buckets, chunked), seed
# 4321 (no sweep or study uses it). About 150 steps, 2-4 s on 2 cores.
PROBE_DECODE_SIZES = (4, 12, 32)
PROBE_CONTEXT = 128


def probe_workloads(vocab_size: int, max_num_seqs: int, max_model_len: int, token_budget: int = 256) -> list:
    """The probe's runs (each a workload run on its own): its decode groups, then its prefill run."""
    import numpy as np

    from cbjax.bench.requests import WorkloadRequest

    rng = np.random.default_rng(4321)

    def prompt(n: int) -> tuple:
        return tuple(int(x) for x in rng.integers(3, vocab_size, n))

    ctx = min(PROBE_CONTEXT, max_model_len // 2)  # (a small test engine's max_model_len)
    runs = []
    for n in sorted({min(x, max_num_seqs) for x in PROBE_DECODE_SIZES}):
        fill_steps = -(-n * ctx // max(token_budget - n, 1))
        out_len = max(1, min(DECODE_STEPS + 1 + fill_steps, max_model_len - ctx))
        runs.append([WorkloadRequest(f"p{n}-{i}", 0.0, prompt(ctx), out_len) for i in range(n)])
    lens = [min(int(k), max_model_len - 4) for k in rng.integers(200, 301, 4)]
    runs.append([WorkloadRequest(f"pp-{i}", 0.0, prompt(k), 2) for i, k in enumerate(lens)])
    return runs


@dataclasses.dataclass
class SpeedProbe:
    measured_s: float  # the probe's steps, summed
    predicted_s: float  # the cost model's prediction of the same steps, summed
    steps: int

    @property
    def scale(self) -> float:
        """measured / predicted: the sim_step_time_scale that makes the cost model run at this minute's speed."""
        return self.measured_s / self.predicted_s

    def as_dict(self) -> dict:
        return dict(measured_s=self.measured_s, predicted_s=self.predicted_s, steps=self.steps, scale=self.scale)


def probe_speed(engine, cost) -> SpeedProbe:
    """Time the probe's steps on `engine` (a warm real engine on a VirtualClock, idle: nothing running or waiting)
    and compare them with `cost`'s predictions (anything with step_time(StepFeatures))."""
    sc = engine.config.scheduler
    feats, times = [], []
    for wl in probe_workloads(engine.model_config.vocab_size, sc.max_num_seqs, sc.max_model_len,
                              sc.max_num_batched_tokens):  # fmt: skip
        f, t, _ = measure(engine, wl)
        feats += f
        times += t
    predicted = sum(map(cost.step_time, feats))
    return SpeedProbe(measured_s=sum(times), predicted_s=predicted, steps=len(times))


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
    sc = cfg.scheduler
    workloads = sweep_workloads(
        engine.model_config.vocab_size,
        sc.max_num_seqs,
        sc.max_model_len,
        seed,
        scale,
        sc.max_num_batched_tokens,
        engine.scheduler.pool.num_pages * cfg.cache.page_size,
    )
    for name, runs in workloads.items():
        n0, t0 = len(feats), sum(times)
        for wl in runs:
            f, t, _ = measure(engine, wl)
            feats += f
            times += t
        counts[name] = len(feats) - n0
        log(f"{name}: {counts[name]} steps in {len(runs)} run(s), {sum(times) - t0:.2f} s measured")
    del engine
    # Swaps: a pool small enough that the mix preempts (its own engine: a different KV shape).
    swap_opts = dict(opts, num_pages=48, watermark_fraction=0.0, preemption_mode="swap", swap_space_gib=0.25)
    swapper = LLMEngine(model, clock=VirtualClock(), **swap_opts)
    swapper.wait_until_warm()
    # A few requests: a small pool thrashes for many steps, which would outweigh the other sweeps in the fit.
    f, t, _ = measure(swapper, workloads["mixed"][0][:40])
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
