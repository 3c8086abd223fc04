"""Offline throughput on a JSON workload in the peers' format (../shared/peers/make_workload.py).

  python -m experiments.throughput --workload WL.json --model llama-tiny [--max_num_seqs 256 ...]

Greedy, EOS ignored (--noignore_eos: requests stop at EOS, for a trained model such as tinypy), warmup (compiling
every bucket) excluded from the timed region. Prints one JSON line {method, requests, output_tokens, wall_s,
output_tok_per_s, ...} with the engine options used and a per-step profile (host vs device time, padding waste,
compiles after warmup, `block_wasted_tokens`: rows blocks of decode steps computed for nothing). With --repeats
N the workload runs N times on the same engine and wall_s is the median.

--replay_device: after each timed run, that run's steps (their packed inputs, recorded) run again back to back
with no host work in between. That is the device time the run needed; each run's 1 - device-only / wall is the
share of its wall time the host added, overlapped or not (with async scheduling the host packs step n+1 while
step n runs, so only what it could not hide shows). `host_overhead` is the median over the runs and
`device_only_s` the median replay: a run and its replay share the same minute of a noisy machine.

`host_busy_share` (always): the median over the runs of the host's working time over the run's wall time: every
`LLMEngine.step()` call's wall time (timed by this harness around the call) less the waits for the device and the
swap copies of the steps it received (their step records' `device_s` and `swap_s`). That is all the host work of a
step (schedule, pack, launch, receive, building the outputs), overlapped with the device or not; measured the same
way whatever tree the engine comes from. It bounds what the host can add to a run and, unlike the replay, needs no
second timing of a machine whose speed drifts between runs. `host_busy_share_receive`: the earlier figure, from the
step records' `host_s` only, which ends when a step's results are received (before its outputs are built).

--host_split: the serving thread's CPU time per step, split into schedule, pack, launch (the program call), fetch,
update and the rest of the engine's step (cbjax/bench/host_timers.py), medians over the runs; and
`host_cpu_share`, the host's CPU time over the wall time.

--stream: drive the engine's step directly with every token streamed, as the server does (each step gives every
request that got a token its delta, and the loop reads it), instead of `LLM.generate`, which asks the engine for
finished outputs only. The loop reads the deltas in bulk (`LLMEngine.step_deltas()`: a plain request's one new
token in two lists, no object per token) and the other outputs' by `RequestOutput.stream_delta()` (an older
tree's engine: `step()`, and `outputs[0].new_token_ids` where it has no `stream_delta`). The deltas read are
checked against the final outputs after each run.

--doc_data PATH: also write a data file for the docs (cbjax/bench/doc_data.py): one run per timed repeat (its
wall time, throughput, host shares) with the workload, model, dtype and engine options as labels, and this
process's whole JSON line as `result`. experiments/throughput_vs_vllm.py runs this script and vLLM in rounds.
"""

import json
import os
import pathlib
import statistics
import time

from absl import app, flags

flags.DEFINE_string("workload", None, "JSON list of {prompt_token_ids, max_new_tokens}", required=True)
flags.DEFINE_string("model", "llama-tiny", "named model config")
flags.DEFINE_string("policy", "fcfs", "scheduling policy")
flags.DEFINE_integer("max_num_seqs", 256, "slots per step")
flags.DEFINE_integer("max_num_batched_tokens", 2048, "token budget per step")
flags.DEFINE_integer("page_size", 16, "tokens per KV page")
flags.DEFINE_integer("num_pages", None, "KV pages (default: from --kv_cache_memory_gib)")
flags.DEFINE_float("kv_cache_memory_gib", 2.0, "KV cache budget when --num_pages is not set")
flags.DEFINE_integer("max_model_len", None, "default: the workload's longest prompt + output, at least 512")
flags.DEFINE_string("dtype", "float32", "float32 or bfloat16")
flags.DEFINE_string("matmul_dtype", None, "bfloat16: bf16 weights and matmul inputs, f32 accumulation")
flags.DEFINE_string("kv_cache_dtype", "auto", "KV pages: auto | float32 | bfloat16 | int8 (docs/memory.md)")
flags.DEFINE_string("attention_backend", "auto", "auto | pallas | xla")
flags.DEFINE_bool("async_scheduling", True, "schedule step n+1 while step n runs")
flags.DEFINE_integer(
    "num_scheduler_steps", None, "decode steps per dispatch where nothing waits (core/multi_step.py); default: LLM's"
)
flags.DEFINE_integer("tensor_parallel_size", 1, "devices the weights and KV heads are split over (docs/scale.md)")
flags.DEFINE_integer("data_parallel_size", 1, "engine replicas behind a router (docs/scale.md)")
flags.DEFINE_bool("ignore_eos", True, "generate every max_new_tokens (the peers' protocol); False: stop at EOS")
flags.DEFINE_integer("repeats", 1, "timed runs on the same engine; wall_s is their median")
flags.DEFINE_bool("replay_device", False, "time the last run's steps again with no host work (device-only time)")
flags.DEFINE_bool("host_split", False, "time the host's CPU per step by part (cbjax/bench/host_timers.py)")
flags.DEFINE_bool("stream", False, "LLMEngine.step() streaming every token (the server's way) instead of LLM.generate")
flags.DEFINE_string("dump_dir", None, "write the generated token ids to DIR/cbjax.json (for peers/compare.py)")
flags.DEFINE_string("doc_data", None, "also write a data file for the docs: one run per timed repeat")
FLAGS = flags.FLAGS


def record_steps(runner) -> list:
    """Keep every dispatched step that ran a program (its packed input, for the device-only replay), through the
    runner's `on_dispatch` hook."""
    steps = []

    def record(handle) -> None:
        if handle.inp is not None:  # (not a swap-only step)
            steps.append(handle)

    runner.on_dispatch = record
    return steps


def replay_steps(runner, steps) -> float:
    """Seconds to run the recorded steps' inputs back to back, waiting only at the end."""
    import jax

    t0 = time.perf_counter()
    for handle in steps:
        tokens = runner.run_input(handle.inp, handle.verified)
    jax.block_until_ready(tokens)
    return time.perf_counter() - t0


def load_workload() -> tuple[list, list, list]:
    """--workload's requests: (the JSON list, prompts, SamplingParams: greedy, EOS as --ignore_eos says)."""
    from cbjax import SamplingParams

    wl = json.loads(pathlib.Path(FLAGS.workload).read_text())
    prompts = [w["prompt_token_ids"] for w in wl]
    params = [SamplingParams(max_tokens=w["max_new_tokens"], temperature=0.0, ignore_eos=FLAGS.ignore_eos) for w in wl]
    return wl, prompts, params


def engine_options(wl: list) -> dict:
    """The engine's options from the flags (the peers' defaults), every program built before the timed runs."""
    max_len = max(len(w["prompt_token_ids"]) + w["max_new_tokens"] for w in wl)
    opts = dict(
        policy=FLAGS.policy,
        max_num_seqs=FLAGS.max_num_seqs,
        max_num_batched_tokens=FLAGS.max_num_batched_tokens,
        page_size=FLAGS.page_size,
        num_pages=FLAGS.num_pages,
        kv_cache_memory_gib=FLAGS.kv_cache_memory_gib,
        max_model_len=FLAGS.max_model_len or max(max_len, 512),
        dtype=FLAGS.dtype,
        matmul_dtype=FLAGS.matmul_dtype,
        kv_cache_dtype=FLAGS.kv_cache_dtype,
        attention_backend=FLAGS.attention_backend,
        async_scheduling=FLAGS.async_scheduling,
        tensor_parallel_size=FLAGS.tensor_parallel_size,
        warmup="full",  # every step program built before the timed runs
    )
    if FLAGS.num_scheduler_steps is not None:
        opts["num_scheduler_steps"] = FLAGS.num_scheduler_steps
    return opts


def time_step_calls(engine) -> list:
    """Wrap `engine.step` (an attribute of this instance: LLM.generate and this harness call it through the
    engine) to append each call's (wall seconds, device wait + swap seconds of the steps it received) to the list
    returned. Reads only the step records, so it measures any tree's engine the same way."""
    calls, records = [], engine.step_records

    def timed(step):
        def timed_step():
            n, t0 = len(records), time.perf_counter()
            outputs = step()
            wall = time.perf_counter() - t0
            calls.append((wall, sum(r["device_s"] + r["swap_s"] for r in records[n:])))
            return outputs

        return timed_step

    engine.step = timed(engine.step)
    if hasattr(engine, "step_deltas"):  # (the same step read in bulk: --stream's loop)
        engine.step_deltas = timed(engine.step_deltas)
    return calls


def stream_run(engine, prompts: list, params: list, tag: str) -> list:
    """The workload through `engine.step()` with streaming on, as a server runs it: every step's outputs read, each
    request's deltas collected. Returns the final outputs in prompt order; raises if the deltas read do not add up
    to them."""
    from cbjax.core.outputs import RequestOutput

    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for rid, prompt, sp in zip(ids, prompts, params):
        engine.add_request(rid, prompt, sp)
    streamed, engine.stream_outputs = engine.stream_outputs, True
    lazy = hasattr(RequestOutput, "stream_delta")  # (False: an older tree's engine, see --before_tree of host_time)
    bulk = hasattr(engine, "step_deltas")  # (an older tree's engine has step() only)
    deltas: dict[str, list[int]] = {rid: [] for rid in ids}
    finished = {}
    try:
        while engine.has_unfinished_requests():
            if bulk:  # each plain request's one new token in two lists, the other outputs as step() returns them
                step = engine.step_deltas()
                for rid, token in zip(step.request_ids, step.token_ids):
                    deltas[rid].append(token)
                outputs = step.outputs
            else:
                outputs = engine.step()
            for out in outputs:
                deltas[out.request_id] += out.stream_delta() if lazy else out.outputs[0].new_token_ids
                if out.finished:
                    finished[out.request_id] = out
    finally:
        engine.stream_outputs = streamed
    outs = [finished[rid] for rid in ids]
    for rid, out in zip(ids, outs):
        if deltas[rid] != out.outputs[0].token_ids:
            raise RuntimeError(f"request {rid}: the streamed deltas differ from its final output")
    return outs


def request_latency_ms(outs) -> dict:
    """TTFT and TPOT percentiles in ms ({ttft,tpot}_ms_{p50,p90,p99}) of a run's outputs, vLLM's definitions:
    TTFT from arrival (queueing included) to the first token, TPOT = (E2E - TTFT) / (output tokens - 1)."""
    from cbjax.bench.metrics import percentiles

    ttft, tpot = [], []
    for o in outs:
        m, n = o.metrics, len(o.outputs[0].token_ids)
        ttft.append(m.first_token_time - m.arrival_time)
        if n > 1:
            tpot.append((m.finished_time - m.first_token_time) / (n - 1))
    out = {}
    for name, values in (("ttft", ttft), ("tpot", tpot)):
        for p, v in percentiles(values).items():
            if p.startswith("p"):
                out[f"{name}_ms_{p}"] = round(1e3 * v, 3)
    return out


def command_line(argv: list, drop: str = "--doc_data") -> str:
    """This run's command as a reader would type it, without `drop` (the file it writes) and its value."""
    args, skip = [], False
    for arg in argv:
        if skip or arg.startswith(drop + "="):
            skip = False
            continue
        skip = arg == drop
        if not skip:
            args.append(arg)
    return " ".join(["python -m experiments.throughput", *args])


def write_runs(path: str, result: dict) -> None:
    """The data file of --doc_data: one run per timed repeat, labelled, and the whole result line kept."""
    import sys

    from cbjax.bench.doc_data import write_doc_data

    labels = {
        "workload": os.path.basename(FLAGS.workload),
        "model": FLAGS.model,
        "engine": "cbjax",
        "dtype": FLAGS.matmul_dtype or FLAGS.dtype,
        "num_scheduler_steps": result.get("num_scheduler_steps"),
        "stream": FLAGS.stream,
    }
    per_run = {"host_busy_share": "host_busy_share_runs", "host_cpu_share": "host_cpu_share_runs"}
    per_run["host_busy_share_receive"] = "host_busy_share_receive_runs"
    per_run["host_overhead"] = "host_overhead_runs"
    runs = []
    for i, wall in enumerate(result["wall_s_runs"]):
        run = {**labels, "repeat": i + 1, "wall_s": wall, "output_throughput": round(result["output_tokens"] / wall, 2)}
        run |= {k: result[v][i] for k, v in per_run.items() if v in result}
        runs.append(run)
    what = "offline output throughput per timed repeat"
    load = os.getloadavg()[0]
    write_doc_data(path, command=command_line(sys.argv[1:]), runs=runs, what=what, result=result, load_average=load)


def main(argv):
    del argv
    from cbjax import LLM
    from cbjax.bench.host_timers import HostTimers
    from cbjax.bench.results import cpu_model

    wl, prompts, params = load_workload()
    opts = engine_options(wl)
    t = time.perf_counter()
    llm = LLM(FLAGS.model, data_parallel_size=FLAGS.data_parallel_size, **opts)
    setup_s = time.perf_counter() - t
    engine = llm.engine
    compiles_before = engine.num_compiles
    walls, outs, replays, host_busy, host_receive = [], None, [], [], []
    calls = time_step_calls(engine)
    recorded = record_steps(engine.runner) if FLAGS.replay_device else None
    timers = HostTimers(engine) if FLAGS.host_split else None
    splits = []
    if FLAGS.stream and FLAGS.data_parallel_size != 1:
        raise app.UsageError("--stream drives one LLMEngine: use it with --data_parallel_size 1")
    for rep in range(FLAGS.repeats):
        if recorded is not None:
            recorded.clear()
        first_step = len(engine.step_records)
        calls.clear()
        if timers is not None:
            timers.reset()
        t0 = time.perf_counter()
        outs = stream_run(engine, prompts, params, f"r{rep}") if FLAGS.stream else llm.generate(prompts, params)
        walls.append(time.perf_counter() - t0)
        steps = engine.step_records[first_step:]
        host_busy.append(sum(wall - waits for wall, waits in calls) / walls[-1])
        host_receive.append(sum(s["host_s"] for s in steps) / walls[-1])
        if timers is not None:
            splits.append(timers.per_step_ms(len(steps)) | {"cpu_share": timers.cpu_s["step"] / walls[-1]})
        if recorded is not None:
            replays.append(replay_steps(engine.runner, recorded))
    got = sum(len(o.outputs[0].token_ids) for o in outs)
    latency = request_latency_ms(outs)
    wall = statistics.median(walls)
    host = [s["host_s"] for s in steps]
    dev = [s["device_s"] for s in steps]
    sched = sum(s["num_scheduled_tokens"] for s in steps)
    padded = sum(s["padded_tokens"] for s in steps)
    result = {
        "method": f"cbjax_{FLAGS.policy}",
        "model": FLAGS.model,
        "requests": len(wl),
        "output_tokens": got,
        "wall_s": round(wall, 3),
        "output_tok_per_s": round(got / wall, 2),
        "wall_s_runs": [round(w, 3) for w in walls],
        "setup_s": round(setup_s, 1),
        "warmup_s": round(engine.warmup_s, 1),
        "steps": len(steps),  # dispatches: a block of decode steps counts once
        "decode_blocks": sum(1 for s in steps if s["decode_steps"] > 1),
        "block_wasted_tokens": sum(s["block_wasted_tokens"] for s in steps),
        "host_ms_per_step": round(1e3 * statistics.mean(host), 3),  # per dispatch (a block of steps counts once)
        "host_busy_share": round(statistics.median(host_busy), 4),
        "host_busy_share_runs": [round(h, 4) for h in host_busy],
        "host_busy_share_receive": round(statistics.median(host_receive), 4),
        "host_busy_share_receive_runs": [round(h, 4) for h in host_receive],
        "device_wait_ms_per_step": round(1e3 * statistics.mean(dev), 3),
        "padding_waste": round(1 - sched / padded, 4),
        "mean_seqs_per_step": round(statistics.mean(s["num_scheduled_seqs"] for s in steps), 1),
        "preemptions": sum(s["num_preemptions"] for s in steps),
        "compiles_warmup": compiles_before,
        "compiles_after_warmup": engine.num_compiles - compiles_before,
        **latency,  # the last run's TTFT / TPOT (offline: all arrive at the start)
        **{k: v for k, v in engine.config.options().items() if k in opts or k in ("num_pages", "num_scheduler_steps")},
        "stream": FLAGS.stream,
        "cpu": cpu_model(),
    }
    if splits:
        result["host_cpu_ms_per_step"] = {
            k: statistics.median(s[k] for s in splits) for k in splits[0] if k != "cpu_share"
        }
        result["host_cpu_share"] = round(statistics.median(s["cpu_share"] for s in splits), 4)
        result["host_cpu_share_runs"] = [round(s["cpu_share"], 4) for s in splits]
    if replays:
        result["device_only_s"] = round(statistics.median(replays), 3)
        result["host_overhead"] = round(statistics.median(1 - d / w for d, w in zip(replays, walls)), 4)
        result["host_overhead_runs"] = [round(1 - d / w, 4) for d, w in zip(replays, walls)]
    print(json.dumps(result), flush=True)
    if FLAGS.doc_data:
        write_runs(FLAGS.doc_data, result)
    if FLAGS.dump_dir:
        os.makedirs(FLAGS.dump_dir, exist_ok=True)
        with open(os.path.join(FLAGS.dump_dir, "cbjax.json"), "w") as f:
            json.dump([o.outputs[0].token_ids for o in outs], f)


if __name__ == "__main__":
    app.run(main)
