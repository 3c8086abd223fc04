"""The real engine's steps as the simulator's cost models see them: features and measured seconds, step by step
(shared by experiments/calibrate.py and experiments/sim_fidelity.py)."""


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


def write_steps(path: str, groups: dict[str, tuple[list, list]]) -> None:
    """Write measured steps as JSONL, one line per step: {"sweep": group name, "seconds": ..., features...}."""
    import json

    with open(path, "w") as f:
        for name, (feats, times) in groups.items():
            for ft, t in zip(feats, times, strict=True):
                f.write(json.dumps({"sweep": name, "seconds": t, **ft.as_dict()}) + "\n")
