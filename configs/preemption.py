"""Preemption by recompute vs swap, with a KV pool far too small for the load.

  python -m experiments.compare_policies --config=configs/preemption.py
  # docs/experiments.md's table (under a minute): three interleaved repeats, ratios to recompute, a data file
  python -m experiments.compare_policies --config=configs/preemption.py --config.repeats=3 \
      --config.baseline=recompute --config.doc_data=docs/data/preemption_2026-12-04.json

The chat/RAG/code mix offline (all at t=0) into 1024 KV tokens for 32 slots: sequences are preempted all the time.
Both modes must finish every request with the same outputs; the table reports the recomputed tokens and the
megabytes swapped (out + in), and steps.jsonl the bytes and copy time per step. About 2 minutes on 2 CPU cores.
Every field not set here is base.py's (see the comments there).
"""

from cbjax.bench.config_files import sibling_config


def get_config():
    c = sibling_config(__file__, "base.py")
    c.run_name = "preemption"  # results/preemption/
    c.policies = ("recompute", "swap")
    c.variants.recompute = dict(policy="fcfs", preemption_mode="recompute")
    c.variants.swap = dict(policy="fcfs", preemption_mode="swap")
    c.clock = "virtual"  # measured step times
    c.engine.num_pages = 64  # 1024 KV tokens: a few long requests fill it
    c.engine.watermark_fraction = 0.0  # admit while a page is free: preemption does the rest
    c.engine.max_model_len = 512  # so that one request always fits the pool
    c.engine.swap_space_gib = 0.25  # host pool for swapped pages
    c.workload.arrival = "offline"
    c.workload.num_requests = 160
    return c
