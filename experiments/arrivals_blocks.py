"""What streamed blocks of decode steps cost a run whose requests keep arriving: time to first token, inter-token
latency, throughput and the host's busy share with `num_scheduler_steps` 1 (LLMEngine's default) against blocks.

  python -m experiments.arrivals_blocks --rate 12 --requests 160 --steps 1,8,16 --rounds 2 \\
      [--lock /tmp/cbjax_measure.lock] --doc_data docs/data/arrivals_blocks_DATE.json

One process, one llama-tiny engine per setting (all built and warmed first), the same Poisson arrivals (`--seed`)
for each; every round runs each setting once, in order. The loop is a server's: requests are added when their
arrival time has come (on the wall clock), each step is read in bulk (`LLMEngine.step_deltas()`), and the loop
sleeps only when nothing runs. A request arriving during a streaming block asks it to end after its running step
(cbjax/runner/token_stream.py); before that commit it waited for the block's end. Per run: TTFT and ITL
percentiles (from each request's RequestMetrics), output tokens per second over the run, and the host's busy share
(each step call's wall time less the device waits its step records hold, over the run's wall time).

`--harness`: the same arrivals through the online harness instead (`cbjax.bench.online.run_online`, as the main job
and every policy comparison run): `LLMEngine.step()` with final outputs only (`stream_outputs` off), the block's rows
streaming all the same so that an arrival can end it (LLMEngine.stream_rows); TTFT and ITL from its request records.
"""

import json
import statistics
import time

import numpy as np
from absl import app, flags

from experiments.measurement_lock import held

flags.DEFINE_float("rate", 12.0, "mean arrivals per second (Poisson)")
flags.DEFINE_integer("requests", 160, "requests per run")
flags.DEFINE_integer("prompt_len", 64, "prompt tokens")
flags.DEFINE_integer("output_len", 128, "output tokens (EOS ignored)")
flags.DEFINE_string("steps", "1,8,16", "num_scheduler_steps settings, comma-separated")
flags.DEFINE_integer("rounds", 2, "rounds; each runs every setting once")
flags.DEFINE_integer("seed", 0, "arrivals and prompts")
flags.DEFINE_string("lock", None, "flock held for each run (the machine's measurement lock)")
flags.DEFINE_string("doc_data", None, "write the docs' data file here")
flags.DEFINE_bool("harness", False, "run through the online harness (final outputs only) instead of a server's loop")
FLAGS = flags.FLAGS


def workload() -> tuple[list[float], list[list[int]]]:
    """Arrival offsets (seconds from the run's start) and prompts, the same for every setting."""
    rng = np.random.default_rng(FLAGS.seed)
    gaps = rng.exponential(1.0 / FLAGS.rate, FLAGS.requests)
    prompts = rng.integers(3, 500, (FLAGS.requests, FLAGS.prompt_len)).tolist()
    return np.cumsum(gaps).tolist(), prompts


def run(engine, offsets: list[float], prompts: list[list[int]], tag: str) -> dict:
    """The workload through `engine` as a server runs it; returns the run's figures."""
    from cbjax import SamplingParams

    params = SamplingParams(max_tokens=FLAGS.output_len, temperature=0.0, ignore_eos=True)
    clock, records = engine.clock, engine.step_records
    first_record, busy, start, i, n, finals = len(records), 0.0, time.perf_counter(), 0, len(offsets), {}
    base = clock.now()
    while i < n or engine.has_unfinished_requests():
        now = time.perf_counter() - start
        while i < n and offsets[i] <= now:
            engine.add_request(f"{tag}-{i}", prompts[i], params, arrival_time=base + offsets[i])
            i += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, offsets[i] - (time.perf_counter() - start)))
            continue
        k, t0 = len(records), time.perf_counter()
        step = engine.step_deltas()
        busy += time.perf_counter() - t0 - sum(r["device_s"] + r["swap_s"] for r in records[k:])
        for out in step.outputs:
            if out.finished:
                finals[out.request_id] = out
    wall = time.perf_counter() - start
    done = [o.metrics for o in finals.values()]
    tokens = sum(len(o.outputs[0].token_ids) for o in finals.values())
    return figures(done, tokens, wall, busy, records[first_record:])


def run_harness(engine, offsets: list[float], prompts: list[list[int]], tag: str) -> dict:
    """The workload through the online harness (run_online), each step() call timed as `run` times them."""
    from cbjax.bench.online import run_online
    from cbjax.bench.requests import WorkloadRequest

    workload = [
        WorkloadRequest(f"{tag}-{i}", t, tuple(p), FLAGS.output_len) for i, (t, p) in enumerate(zip(offsets, prompts))
    ]
    records, step, busy = engine.step_records, engine.step, [0.0]
    first_record = len(records)

    def timed_step():
        k, t0 = len(records), time.perf_counter()
        outputs = step()
        busy[0] += time.perf_counter() - t0 - sum(r["device_s"] + r["swap_s"] for r in records[k:])
        return outputs

    engine.step = timed_step
    try:
        result = run_online(engine, workload)
    finally:
        del engine.step  # (the instance attribute: the class's method again)
    done = [r for r in result.requests if r.completed]
    assert len(done) == len(workload), "a request did not complete"
    return figures(done, sum(r.output_len for r in done), result.wall_s, busy[0], records[first_record:])


def figures(done: list, tokens: int, wall: float, busy: float, records: list[dict]) -> dict:
    """A run's figures from its requests' times (RequestMetrics or RequestRecords: arrival, first token and token
    times on one clock), its output tokens, wall time, host busy seconds and step records."""
    ttft = [r.first_token_time - r.arrival_time for r in done]
    itl = [b - a for r in done for a, b in zip(r.token_times, r.token_times[1:])]
    q = lambda xs, p: 1e3 * float(np.percentile(xs, p))
    return {
        "requests": len(done),
        "wall_s": wall,
        "output_throughput": tokens / wall,
        "ttft_ms_p50": q(ttft, 50),
        "ttft_ms_p90": q(ttft, 90),
        "ttft_ms_p99": q(ttft, 99),
        "itl_ms_p50": q(itl, 50),
        "itl_ms_p99": q(itl, 99),
        "host_busy_share": busy / wall,
        "blocks": sum(1 for r in records if r["decode_steps"] > 1),
    }


def main(argv):
    del argv
    from cbjax import LLMEngine
    from cbjax.bench.doc_data import write_doc_data

    settings = [int(s) for s in FLAGS.steps.split(",")]
    engines = {}
    for n in settings:
        engines[n] = LLMEngine("llama-tiny", num_scheduler_steps=n, max_num_seqs=64, max_model_len=512, warmup="full")
        engines[n].wait_until_warm()
    offsets, prompts = workload()
    runs = []
    for rnd in range(1, FLAGS.rounds + 1):
        for n in settings:
            with held(FLAGS.lock):
                measured = (run_harness if FLAGS.harness else run)(engines[n], offsets, prompts, f"r{rnd}-n{n}")
            runs.append({"num_scheduler_steps": n, "round": rnd, "pair": rnd, **measured})
            print(json.dumps(runs[-1]), flush=True)
    for n in settings:
        mine = [r for r in runs if r["num_scheduler_steps"] == n]
        summary = {k: statistics.median(r[k] for r in mine) for k in ("ttft_ms_p50", "ttft_ms_p90", "itl_ms_p50")}
        print(n, json.dumps(summary))
    if FLAGS.doc_data:
        what = "time to first token, inter-token latency, throughput and host busy share with Poisson arrivals"
        command = (
            f"python -m experiments.arrivals_blocks --rate {FLAGS.rate:g} --requests {FLAGS.requests} "
            f"--prompt_len {FLAGS.prompt_len} --output_len {FLAGS.output_len} --steps {FLAGS.steps} "
            f"--rounds {FLAGS.rounds} --seed {FLAGS.seed}" + (" --harness" if FLAGS.harness else "")
        )
        write_doc_data(FLAGS.doc_data, command=command, what=what, runs=runs)


if __name__ == "__main__":
    app.run(main)
