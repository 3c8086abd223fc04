"""A seconds-long smoke run of the comparison (test-tiny model, a dozen requests, virtual clock); the tests use it.

  python -m experiments.compare_policies --config=configs/compare_tiny.py

Every field not set here is base.py's (see the comments there).
"""

from cbjax.bench.config_files import sibling_config


def get_config():
    c = sibling_config(__file__, "base.py")
    c.model = "test-tiny"  # 2 layers, vocab 512: compiles in seconds
    c.run_name = "compare_tiny"  # results/compare_tiny/
    c.clock = "virtual"  # simulated time: reproducible, never sleeps
    c.step_cost_ms = 10.0  # every step costs 10 ms of virtual time
    c.engine.max_num_seqs = 4  # small batches, so 12 requests make several
    c.engine.max_num_batched_tokens = 16  # one token bucket: one compile
    c.engine.num_pages = 64  # 1024 KV tokens
    c.engine.max_model_len = 128  # test-tiny prompts stay short
    c.engine.static_batch_timeout_s = 0.05  # static waits up to 50 ms for a full batch
    c.time_window.window_ms = 50.0  # the client holds arrivals for 50 ms ...
    c.time_window.max_batch = 4  # ... or 4 requests
    c.workload.kind = "synthetic"  # independent uniform lengths
    c.workload.num_requests = 12
    c.workload.request_rate = 50.0  # faster than 4 slots drain, so batches form
    c.workload.scale = 1.0
    # Length distributions are mappings, not the ints the base's placeholders take: replace the fields.
    del c.workload["prompt_len"], c.workload["output_len"]
    c.workload.prompt_len = dict(dist="uniform", low=4, high=40)  # prompt tokens
    c.workload.output_len = dict(dist="uniform", low=2, high=16)  # max_tokens
    c.workload.long_threshold = 40  # prompt + output above this is "long": about a third of the requests
    c.slo.ttft_ms = 100.0
    c.slo.tpot_ms = 20.0
    return c
