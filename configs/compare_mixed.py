"""The long/short stress test: the chat/RAG/code mix offline, static vs continuous batching; measures the
continuous/static output-throughput ratio. About 3-4 minutes on 2 CPU cores with cold compiles; 75 s for three
repeats with the compilation cache warm (2026-12-04).

  python -m experiments.compare_policies --config=configs/compare_mixed.py
  # docs/experiments.md's tables: three interleaved repeats, ratios to static, a data file for the docs
  python -m experiments.compare_policies --config=configs/compare_mixed.py --config.repeats=3 \
      --config.baseline=static --config.doc_data=docs/data/compare_mixed_2026-12-04.json

Offline (every request at t=0) so throughput is the engine's, not the arrival rate's. Every field not set here is
base.py's (see the comments there).
"""

from cbjax.bench.config_files import sibling_config


def get_config():
    c = sibling_config(__file__, "base.py")
    c.run_name = "compare_mixed"  # results/compare_mixed/
    c.policies = ("static", "fcfs")  # time_window equals static when everything arrives at once
    c.engine.static_batch_timeout_s = 0.0  # offline: a static batch starts with whatever waits (max_num_seqs)
    c.workload.arrival = "offline"  # all requests at t=0
    c.workload.num_requests = 480  # 15 static batches of 32; enough that the final drain is a small part
    c.workload.scale = 0.125  # chat ~32/16, RAG ~256/16, code ~64/128 prompt/output tokens (medians)
    return c
