"""float32 vs int8 KV pages under one fixed KV memory budget: what the smaller pages buy a continuous batcher.

  python -m experiments.compare_policies --config=configs/kv_int8.py

llama-tiny (random weights) under fcfs, the chat/RAG/code mix at 1/4 lengths, offline, into 8 MiB of KV: float32
pages (32 KiB each, 16 tokens) give 256 pages = 4,096 tokens; int8 pages (9 KiB with their scales) give 910 pages =
14,560 tokens. The table's `slots` and summary.json's `running_mean` (admitted concurrency), preemptions and
throughput show the difference. About a minute on 2 CPU cores.
Every field not set here is base.py's (see the comments there).
"""

from cbjax.bench.config_files import sibling_config


def get_config():
    c = sibling_config(__file__, "base.py")
    c.model = "llama-tiny"
    c.run_name = "kv_int8"  # results/kv_int8/
    c.policies = ("kv_float32", "kv_int8")
    c.variants.kv_float32 = dict(policy="fcfs", kv_cache_dtype="auto")
    c.variants.kv_int8 = dict(policy="fcfs", kv_cache_dtype="int8")
    c.clock = "virtual"  # measured step times, no sleeping between offline arrivals
    c.engine.num_pages = None  # the pool comes from the memory budget
    c.engine.kv_cache_memory_gib = 8 / 1024  # 8 MiB
    c.engine.max_num_seqs = 32
    c.engine.max_num_batched_tokens = 512
    c.engine.watermark_fraction = 0.0
    c.workload.arrival = "offline"
    c.workload.num_requests = 96
    c.workload.scale = 0.25
    return c
