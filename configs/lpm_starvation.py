"""Multi-turn sessions and lpm starvation: longest-prefix-match first, without aging, starves the requests the prefix
cache cannot help (SGLang #31954: 5% of the requests carried 75% of all TTFT); aging removes the tail.

  # the simulator (the committed llama-tiny CPU profile), 5 workload seeds, about a minute:
  python -m experiments.compare_policies --config=configs/lpm_starvation.py \
      --config.doc_data=docs/data/lpm_starvation_2026-12-04.json
  # the real engine (llama-tiny on this CPU, measured step times on a virtual clock), one run each, ~3.5 minutes;
  # it ran faster than the committed profile on 2026-12-04, hence the higher rate to reach the same regime:
  python -m experiments.compare_policies --config=configs/lpm_starvation.py --config.engine.runner=model \
      --config.seeds=1 --config.workload.num_requests=300 --config.workload.request_rate=20 \
      --config.doc_data=docs/data/lpm_starvation_real_2026-12-04.json

Conversations (workload kind "sessions", cbjax/bench/sessions.py): each turn's prompt is the previous turn's prompt,
the answer the engine generated and a new message, sent an exponential think time (mean 1 s) after that answer, so
later turns find the conversation in the prefix cache. A fifth of the arrivals are one-shot requests, and every
session's first turn is new too: the cache misses. Sessions start (Poisson) at 10 per second, about the rate the
engine sustains on this workload (fcfs's queue grows, and its prefixes start to be evicted before their next turn).
The rate is absolute, in sessions per second: `workload.load` measures a capacity in requests per second, which is
not the unit of session starts. Every entry has the prefix cache on:
  fcfs            arrival order
  lpm_no_aging    lpm with aging_tokens_per_s=0: plain longest prefix match
  lpm             lpm with its default aging (256 tokens per second waited)
  lpm_aging_1024  four times that aging: nearer arrival order
No horizon: every request completes, so a starved request shows as its TTFT, not as a missing one.
Every field not set here is base.py's.
"""

import os

from cbjax.bench.config_files import sibling_config


def get_config():
    c = sibling_config(__file__, "base.py")
    c.run_name = "lpm_starvation"  # results/lpm_starvation/
    c.policies = ("fcfs", "lpm_no_aging", "lpm", "lpm_aging_1024")
    c.variants.lpm_no_aging = dict(policy="lpm")
    c.variants.lpm_aging_1024 = dict(policy="lpm")
    c.policy_options.lpm_no_aging = dict(aging_tokens_per_s=0.0)
    c.policy_options.lpm_aging_1024 = dict(aging_tokens_per_s=1024.0)
    c.baseline = "fcfs"
    c.seeds = 5  # workload seeds: the simulator's only spread
    c.clock = "virtual"
    c.engine.runner = "sim"  # --config.engine.runner=model: the real engine, measured step times
    c.sim.profile = os.path.join(os.path.dirname(os.path.abspath(__file__)), "profiles", "llama-tiny-cpu.json")
    c.engine.enable_prefix_caching = True
    c.engine.num_pages = 4096  # 64k KV tokens: the active conversations fit when the order keeps them warm
    w = c.workload
    w.kind = "sessions"
    w.num_requests = 400  # arrivals: sessions and one-shot requests (about 2,500 requests in all)
    w.request_rate = 10.0  # session starts per second
    w.scale = 1.0
    del w["prompt_len"], w["output_len"]  # the base's int placeholders; these are mappings
    w.prompt_len = dict(dist="uniform", low=64, high=256)  # a first turn or a one-shot request
    w.message_len = dict(dist="uniform", low=16, high=64)  # each later turn's new message
    w.output_len = dict(dist="uniform", low=16, high=64)  # every answer
    w.num_turns = dict(dist="uniform", low=4, high=12)  # turns per session (cut where 1024 tokens would not fit)
    w.think_time_s = dict(dist="exponential", mean=1.0)
    w.one_shot_fraction = 0.2
    return c
