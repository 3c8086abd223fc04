"""Prefix caching on a shared-system-prompt workload: the same engine with the cache off and on (and lpm order).

  python -m experiments.compare_policies --config=configs/prefix_cache.py
  # docs/experiments.md's table (about 2 minutes): three interleaved repeats, ratios to cache_off, a data file
  python -m experiments.compare_policies --config=configs/prefix_cache.py --config.repeats=3 \
      --config.baseline=cache_off --config.doc_data=docs/data/prefix_cache_2026-12-04.json

8 system prompts of 384 tokens, each request adds a 16-64 token question and asks for 32 tokens; Poisson arrivals
at a rate the uncached engine barely keeps up with. A hit skips the prefill of the cached pages, so TTFT falls;
the outputs must be identical ("same out"). About 2 minutes on 2 CPU cores.
Every field not set here is base.py's (see the comments there).
"""

from cbjax.bench.config_files import sibling_config


def get_config():
    c = sibling_config(__file__, "base.py")
    c.run_name = "prefix_cache"  # results/prefix_cache/
    c.policies = ("cache_off", "cache_on", "lpm_cache_on")
    c.variants.cache_off = dict(policy="fcfs", enable_prefix_caching=False)
    c.variants.cache_on = dict(policy="fcfs", enable_prefix_caching=True)
    c.variants.lpm_cache_on = dict(policy="lpm", enable_prefix_caching=True)
    c.clock = "virtual"  # measured step times, no idle sleeping
    c.workload.kind = "shared_prefix"
    c.workload.num_requests = 200
    c.workload.request_rate = 16.0
    c.workload.scale = 1.0
    c.workload.num_prefixes = 8  # distinct system prompts
    c.workload.prefix_len = 384  # tokens per system prompt (24 pages of 16)
    del c.workload["prompt_len"], c.workload["output_len"]  # the base's int placeholders; these are mappings
    c.workload.prompt_len = dict(dist="uniform", low=16, high=64)  # the question after the system prompt
    c.workload.output_len = 32
    return c
