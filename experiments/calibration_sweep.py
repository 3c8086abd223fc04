"""The calibration sweep, without flags: run it on the real engine and fit a CalibratedCost. Shared by
experiments/calibrate.py (which writes the profile) and experiments/sim_fidelity.py (which, with --recalibrate,
fits a fresh profile right before each case so the machine's load is the same for both)."""

import dataclasses


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
    """name -> workload (cbjax.bench.workload requests)."""
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


def calibrate(model: str, opts: dict, *, seed: int, scale: float, log=print) -> Calibration:
    """Run the sweep on the real engine (`opts`: LLMEngine options) and fit a CalibratedCost to its steps."""
    from cbjax.core.clock import VirtualClock
    from cbjax.engine import LLMEngine
    from cbjax.sim import CalibratedCost
    from experiments.measured_steps import measure

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
