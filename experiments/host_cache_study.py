"""The prefix cache's host tier on multi-turn sessions (the real CPU engine, a real clock): no prefix cache, the
device cache alone, and the device cache with a host tier behind it (core/host_prefix_cache.py), at a device KV pool
too small for the sessions' working set.

  python -m experiments.host_cache_study                                             # prints the runs
  python -m experiments.host_cache_study --doc_data=docs/data/host_cache_DATE.json   # also a data file (docs/memory.md)

The `sessions` workload (cbjax/bench/generators.py session_workload), closed-loop in the online harness
(cbjax/bench/sessions.py): --sessions conversations of --turns turns, each turn's prompt the whole conversation so
far plus a new message, the next turn sent a think time after the answer. While a session thinks, its pages are
released to the prefix cache; with --num_pages device pages the other sessions' turns push them out, so the device
cache alone finds only part of a returning conversation and recomputes the rest, where the host tier copies it back.
Each round (--seeds, one workload seed per round) runs the three configurations back to back, in a rotated order
so that none always runs first; the view (experiments/doc_views.py, `host_cache`) takes medians over the rounds with
their spread. Recorded per run: TTFT p50 / p99 (all turns and later turns), output throughput, the prefix-cache hit
rate, the tokens served by each tier, the pages copied each way, the steps, and the load averages before and after.
"""

import os
import time

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "llama-tiny", "model (random weights: greedy, EOS ignored, so lengths are fixed)")
flags.DEFINE_integer("sessions", 12, "conversations per round")
flags.DEFINE_integer("turns", 4, "turns per conversation")
flags.DEFINE_integer("prompt_len", 320, "first prompt (tokens)")
flags.DEFINE_integer("message_len", 48, "each later turn's new message (tokens)")
flags.DEFINE_integer("output_len", 8, "answer (tokens)")
flags.DEFINE_float("think_time_s", 0.3, "mean think time between a session's turns (exponential)")
flags.DEFINE_float("request_rate", 8.0, "session starts per second (Poisson)")
flags.DEFINE_integer("num_pages", 96, "device KV pages (page_size 16): too few for the sessions' working set")
flags.DEFINE_integer("host_pages", 1024, "host tier pages (num_host_cache_pages) of the device + host configuration")
flags.DEFINE_integer("max_num_seqs", 8, "slots")
flags.DEFINE_integer("max_num_batched_tokens", 128, "tokens per step")
flags.DEFINE_list("seeds", ["0", "1", "2"], "workload seeds, one round each")
flags.DEFINE_string("doc_data", None, "also write the runs to this data file (cbjax/bench/doc_data.py)")

CONFIGS = {  # label -> engine options
    "no prefix cache": dict(enable_prefix_caching=False),
    "device cache": dict(enable_prefix_caching=True),
    "device + host": dict(enable_prefix_caching=True, num_host_cache_pages=None),  # (set from --host_pages)
}
PAGE_SIZE = 16


def engine_options(label: str) -> dict:
    opts = dict(CONFIGS[label])
    if "num_host_cache_pages" in opts:
        opts["num_host_cache_pages"] = FLAGS.host_pages
    return dict(
        opts,
        max_num_seqs=FLAGS.max_num_seqs,
        max_num_batched_tokens=FLAGS.max_num_batched_tokens,
        page_size=PAGE_SIZE,
        num_pages=FLAGS.num_pages,
        max_model_len=max_model_len(),
        watermark_fraction=0.0,
    )


def max_model_len() -> int:
    longest = FLAGS.prompt_len + FLAGS.turns * (FLAGS.message_len + FLAGS.output_len)
    return -(-longest // PAGE_SIZE) * PAGE_SIZE


def workload(seed: int):
    from cbjax.bench.workload import make_workload

    return make_workload(
        dict(
            kind="sessions",
            num_requests=FLAGS.sessions,
            seed=seed,
            arrival="poisson",
            request_rate=FLAGS.request_rate,
            prompt_len=FLAGS.prompt_len,
            message_len=FLAGS.message_len,
            output_len=FLAGS.output_len,
            num_turns=FLAGS.turns,
            think_time_s=dict(dist="exponential", mean=FLAGS.think_time_s),
            vocab_size=32000,
            max_model_len=max_model_len(),
        )
    )


def measure(engine, label: str, seed: int) -> dict:
    """One run of round `seed`'s workload on a fresh, warm engine (empty prefix cache in both tiers)."""
    from cbjax.bench.metrics import summarize
    from cbjax.bench.online import run_online

    warm, load_before = engine.num_compiles, os.getloadavg()
    first_step = len(engine.step_records)
    result = run_online(engine, workload(seed))
    s = summarize(result.requests, result.steps)
    steps = result.steps
    tier = engine.scheduler.host_cache
    page_bytes = engine.runner.host_pool.bytes_per_page if engine.runner.host_pool is not None else 0
    host_hits = sum(x.prefix_host_hit_tokens for x in steps)
    assert s["num_completed"] == s["num_requests"], "every turn completes"
    assert engine.num_compiles == warm, "compiled after warmup"
    return dict(
        config=label,
        seed=seed,
        requests=s["num_requests"],
        ttft_ms_p50=s["ttft_ms_p50"],
        ttft_ms_p99=s["ttft_ms_p99"],
        later_turn_ttft_ms_p50=s["later_turn_ttft_ms_p50"],
        later_turn_ttft_ms_p99=s["later_turn_ttft_ms_p99"],
        output_throughput=s["output_throughput"],
        duration_s=s["duration_s"],
        prefix_hit_rate=s["prefix_cache_hit_rate"],
        queried_tokens=s["prefix_queried_tokens"],
        device_hit_tokens=s["prefix_hit_tokens"] - host_hits,
        host_hit_tokens=host_hits,  # prefill recompute avoided by the host tier
        host_out_pages=sum(x.host_cache_out_pages for x in steps),
        host_in_pages=sum(x.host_cache_in_pages for x in steps),
        host_out_bytes=sum(x.host_cache_out_pages for x in steps) * page_bytes,
        host_in_bytes=sum(x.host_cache_in_pages for x in steps) * page_bytes,
        host_tier_pages=0 if tier is None else tier.num_pages,
        steps=len(engine.step_records) - first_step,
        preemptions=s["request_preemptions"],
        swap_s=s["swap_s"],
        loadavg_before=list(load_before),
        loadavg_after=list(os.getloadavg()),
    )


def build(label: str):
    from cbjax import LLMEngine

    engine = LLMEngine(FLAGS.model, **engine_options(label))
    engine.wait_until_warm()  # (the programs come from the compilation cache after the first engine)
    return engine


def main(argv):
    del argv
    t0 = time.perf_counter()
    labels = list(CONFIGS)
    runs = []
    for r, seed in enumerate(int(s) for s in FLAGS.seeds):
        order = labels[r % len(labels) :] + labels[: r % len(labels)]
        for label in order:
            run = measure(build(label), label, seed)
            runs.append(run)
            print(
                f"seed {seed} {label:16s} TTFT p50 {run['ttft_ms_p50']:7.1f} ms p99 {run['ttft_ms_p99']:7.1f} ms  "
                f"later-turn p50 {run['later_turn_ttft_ms_p50']:7.1f} ms  {run['output_throughput']:6.1f} tok/s  "
                f"hits dev {run['device_hit_tokens']} host {run['host_hit_tokens']}  "
                f"pages out/in {run['host_out_pages']}/{run['host_in_pages']}",
                flush=True,
            )
    print(f"study took {time.perf_counter() - t0:.0f} s")
    if FLAGS.doc_data:
        from cbjax.bench.doc_data import write_doc_data

        command = "python -m experiments.host_cache_study " + " ".join(
            f"--{name}={FLAGS[name].value if not isinstance(FLAGS[name].value, list) else ','.join(FLAGS[name].value)}"
            for name in ("model", "sessions", "turns", "prompt_len", "message_len", "output_len", "think_time_s",
                         "request_rate", "num_pages", "host_pages", "max_num_seqs", "max_num_batched_tokens", "seeds",
                         "doc_data")
        )  # fmt: skip
        write_doc_data(
            FLAGS.doc_data,
            command=command,
            runs=runs,
            what="Multi-turn sessions on the real CPU engine with a device KV pool too small for the working set: "
            "no prefix cache, the device cache alone, and the device cache with a host tier.",
            model=FLAGS.model,
            engine_options={label: engine_options(label) for label in labels},
        )


if __name__ == "__main__":
    app.run(main)
