"""Data-parallel routers compared like policies: 2 engine replicas behind round-robin, least-load and
prefix-affinity routing, each replica with its own prefix cache.

  python -m experiments.compare_policies --config=configs/routers.py
  # docs/scale.md's table (about 2 minutes): three interleaved repeats, ratios to least_load, a data file
  python -m experiments.compare_policies --config=configs/routers.py --config.repeats=3 \
      --config.baseline=least_load --config.doc_data=docs/data/routers_2026-12-04.json

The shared-prefix workload of prefix_cache.py (8 system prompts of 384 tokens, short questions, Poisson arrivals):
prefix affinity sends prompts that start alike to the same replica, so each replica caches fewer distinct prefixes
and hits more. The table's `hit rate` shows it; every entry must generate the same tokens. On one CPU the replicas
share the device and its cores (the virtual clock adds their step times): the comparison is of routing decisions
(hit rate, recomputed prefill, load balance), not of parallel speed. Every field not set here is prefix_cache.py's,
then base.py's.
"""

from cbjax.bench.config_files import sibling_config


def get_config():
    c = sibling_config(__file__, "prefix_cache.py")
    c.run_name = "routers"  # results/routers/
    c.policies = ("round_robin", "least_load", "prefix_affinity")
    for router in c.policies:
        c.variants[router] = dict(policy="fcfs", enable_prefix_caching=True, data_parallel_size=2, router=router)
    c.engine.num_pages = 512  # per replica
    return c
