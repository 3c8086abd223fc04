"""Sliding-window eviction on and off: what freeing the pages a window no longer reads buys a long-context load.

  python -m experiments.compare_policies --config=configs/sliding_window.py

mistral-tiny (llama-tiny's shapes with a 128-token window, random weights) on long prompts (600-1000 tokens, all
at t=0) into a 4096-token KV pool: without eviction a sequence holds its whole context (about 4 fit at once), with
eviction at most window + chunk (decoding: 9 pages of 16). The table's `slots` and summary.json's `running_mean`
(admitted concurrency), `kv_util_mean`, preemptions and throughput show the difference; both runs must generate the
same tokens (the window is a property of attention, not of eviction). About a minute on 2 CPU cores.
Every field not set here is base.py's (see the comments there).
"""

from cbjax.bench.config_files import sibling_config


def get_config():
    c = sibling_config(__file__, "base.py")
    c.model = "mistral-tiny"  # sliding window 128 (cbjax/model/config.py)
    c.run_name = "sliding_window"  # results/sliding_window/
    c.policies = ("evict", "keep")
    c.variants.evict = dict(policy="fcfs", evict_outside_window=True)
    c.variants.keep = dict(policy="fcfs", evict_outside_window=False)
    c.clock = "virtual"  # measured step times, no sleeping between offline arrivals
    c.engine.max_num_batched_tokens = 512
    c.engine.num_pages = 256  # 4096 KV tokens
    c.engine.watermark_fraction = 0.0
    c.engine.max_model_len = 1280
    c.workload.kind = "synthetic"
    c.workload.arrival = "offline"
    c.workload.num_requests = 48
    c.workload.scale = 1.0
    del c.workload["prompt_len"], c.workload["output_len"]
    c.workload.prompt_len = dict(dist="uniform", low=600, high=1000)  # prompt tokens, several windows long
    c.workload.output_len = dict(dist="uniform", low=32, high=96)  # max_tokens
    c.workload.long_threshold = 800
    return c
