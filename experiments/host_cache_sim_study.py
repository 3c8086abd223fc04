"""The prefix cache's host tier on multi-turn sessions, on the simulator: llama-7B shapes on an H200 and on TPU v5e
chips (roofline step times, cbjax/sim/roofline.py), no prefix cache / the device cache alone / the device cache with
a host tier behind it (core/host_prefix_cache.py). The real-engine study on the CPU is experiments/host_cache_study.py.

  python -m experiments.host_cache_sim_study --doc_data=docs/data/host_cache_sim_DATE.json

The `sessions` workload (cbjax/bench/generators.py session_workload), closed-loop in the online harness: sessions
of --turns turns, each turn's prompt the conversation so far plus a new message, the next turn sent a think time
after the answer. The device pool is what the accelerator's memory holds after the weights (90% of HBM); the
workload's sessions (per accelerator: --h200_sessions, --v5e_sessions starting at --*_rate per second) hold more
conversation than that, so returning sessions find part of their context evicted: recomputed with the device
cache alone, copied back over the host link (the roofline's: PCIe Gen5 x16 for the H200, an assumed 32 GB/s for a
v5e host; cbjax/sim/roofline.py) with the tier, whose size is --host_cache_gib. Step times include those copies
(SimRunner prices swap bytes). --seeds workload seeds; medians and intervals in the view.
"""

import os
import sys
import time

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_list("accelerators", ["h200", "tpu-v5e"], "accelerators (cbjax.sim.roofline.ACCELERATORS)")
flags.DEFINE_integer("v5e_chips", 2, "TPU v5e chips (tensor parallel): one holds the weights and ~1.7k KV tokens")
flags.DEFINE_integer("h200_sessions", 240, "H200: sessions per run")
flags.DEFINE_float("h200_rate", 4.0, "H200: session starts per second (Poisson)")
flags.DEFINE_integer("v5e_sessions", 60, "TPU v5e: sessions per run")
flags.DEFINE_float("v5e_rate", 0.5, "TPU v5e: session starts per second (Poisson)")
flags.DEFINE_integer("turns", 4, "turns per session")
flags.DEFINE_integer("prompt_len", 2048, "first prompt (tokens)")
flags.DEFINE_integer("message_len", 256, "each later turn's new message (tokens)")
flags.DEFINE_integer("output_len", 256, "answer (tokens)")
flags.DEFINE_float("think_time_s", 30.0, "mean think time between a session's turns (exponential)")
flags.DEFINE_float("host_cache_gib", 256.0, "host tier of the device + host configuration (GiB)")
flags.DEFINE_integer("seeds", 3, "workload seeds")
flags.DEFINE_string("doc_data", None, "also write the runs to this data file (cbjax/bench/doc_data.py)")

MODEL = "llama-7b"
CONFIGS = {  # label -> engine options
    "no prefix cache": dict(enable_prefix_caching=False),
    "device cache": dict(enable_prefix_caching=True),
    "device + host": dict(enable_prefix_caching=True, host_cache_gib=None),  # (set from --host_cache_gib)
}
PAGE_SIZE = 16
SETTINGS = ("v5e_chips", "h200_sessions", "h200_rate", "v5e_sessions", "v5e_rate", "turns", "prompt_len",
            "message_len", "output_len", "think_time_s", "host_cache_gib", "seeds")  # fmt: skip


def max_model_len() -> int:
    longest = FLAGS.prompt_len + FLAGS.turns * (FLAGS.message_len + FLAGS.output_len)
    return -(-longest // PAGE_SIZE) * PAGE_SIZE


def engine(accelerator: str, label: str):
    from cbjax import LLMEngine

    opts = dict(CONFIGS[label])
    if "host_cache_gib" in opts:
        opts["host_cache_gib"] = FLAGS.host_cache_gib
    chips = FLAGS.v5e_chips if accelerator == "tpu-v5e" else 1
    return LLMEngine(MODEL, runner="sim", sim_accelerator=accelerator, sim_num_chips=chips, dtype="bfloat16",
                     policy="sarathi", max_num_seqs=256, max_num_batched_tokens=2048, page_size=PAGE_SIZE,
                     max_model_len=max_model_len(), **opts)  # fmt: skip


def workload(accelerator: str, seed: int):
    from cbjax.bench.workload import make_workload

    h200 = accelerator == "h200"
    return make_workload(
        dict(
            kind="sessions",
            num_requests=FLAGS.h200_sessions if h200 else FLAGS.v5e_sessions,
            seed=seed,
            arrival="poisson",
            request_rate=FLAGS.h200_rate if h200 else FLAGS.v5e_rate,
            prompt_len=FLAGS.prompt_len,
            message_len=FLAGS.message_len,
            output_len=FLAGS.output_len,
            num_turns=FLAGS.turns,
            think_time_s=dict(dist="exponential", mean=FLAGS.think_time_s),
            vocab_size=32000,
            max_model_len=max_model_len(),
        )
    )


def measure(accelerator: str, label: str, seed: int) -> dict:
    from cbjax.bench.metrics import summarize
    from cbjax.bench.online import run_online

    eng = engine(accelerator, label)
    wall = time.perf_counter()
    result = run_online(eng, workload(accelerator, seed))
    wall = time.perf_counter() - wall
    s = summarize(result.requests, result.steps)
    steps = result.steps
    host_hits = sum(x.prefix_host_hit_tokens for x in steps)
    page_bytes = eng.runner.kv_bytes_per_page
    tier = eng.scheduler.host_cache
    return dict(
        accelerator=accelerator,
        config=label,
        seed=seed,
        requests=s["num_requests"],
        completed=s["num_completed"],
        device_pages=eng.config.cache.num_pages,
        host_tier_pages=0 if tier is None else tier.num_pages,
        ttft_ms_p50=s["ttft_ms_p50"],
        ttft_ms_p99=s["ttft_ms_p99"],
        later_turn_ttft_ms_p50=s["later_turn_ttft_ms_p50"],
        later_turn_ttft_ms_p99=s["later_turn_ttft_ms_p99"],
        output_throughput=s["output_throughput"],
        request_throughput=s["request_throughput"],
        duration_s=s["duration_s"],
        prefix_hit_rate=s["prefix_cache_hit_rate"],
        device_hit_tokens=s["prefix_hit_tokens"] - host_hits,
        host_hit_tokens=host_hits,
        host_out_bytes=sum(x.host_cache_out_pages for x in steps) * page_bytes,
        host_in_bytes=sum(x.host_cache_in_pages for x in steps) * page_bytes,
        preemptions=s["request_preemptions"],
        wall_s=wall,
    )


def main(argv):
    del argv
    from cbjax.sim.roofline import ACCELERATORS

    unknown = [a for a in FLAGS.accelerators if a not in ACCELERATORS]
    if unknown:
        sys.exit(f"host_cache_sim_study: unknown accelerators {unknown}; known: {sorted(ACCELERATORS)}")
    load_before = os.getloadavg()
    runs = []
    for acc in FLAGS.accelerators:
        for seed in range(FLAGS.seeds):
            for label in CONFIGS:
                run = measure(acc, label, seed)
                runs.append(run)
                print(f"{acc} seed {seed} {label:16s} TTFT p50 {run['ttft_ms_p50']:8.1f} ms p99 "
                      f"{run['ttft_ms_p99']:8.1f} ms  {run['output_throughput']:7.1f} tok/s  hits dev "
                      f"{run['device_hit_tokens']} host {run['host_hit_tokens']} ({run['wall_s']:.1f} s)",
                      flush=True)  # fmt: skip
    if FLAGS.doc_data:
        from cbjax.bench.doc_data import write_doc_data

        write_doc_data(
            FLAGS.doc_data,
            command=" ".join(["python -m experiments.host_cache_sim_study", *sys.argv[1:]]),
            runs=runs,
            what="multi-turn sessions on the simulator (roofline, llama-7B shapes): no prefix cache, the device "
            "cache alone, the device cache with a host tier",
            settings={k: FLAGS[k].value for k in SETTINGS},
            load_average_before=list(load_before),
            load_average_after=list(os.getloadavg()),
        )
        print(f"data for the docs: {FLAGS.doc_data}")


if __name__ == "__main__":
    app.run(main)
