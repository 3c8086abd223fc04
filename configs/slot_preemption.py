"""Preemption for a slot (issue 38, point 5): the priority policy with its `preempt_for_slot` option on and off,
when the slots, not the pages, run out.

  python -m experiments.compare_policies --config=configs/slot_preemption.py \
      --config.doc_data=docs/data/slot_preemption_2026-12-04.json
  # the same at load 0.7, then the figure of both (docs/policies.md, "Preemption for a slot")
  python -m experiments.compare_policies --config=configs/slot_preemption.py --config.workload.load=0.7 \
      --config.doc_data=docs/data/slot_preemption_2026-12-04_load0.7.json
  python -m experiments.slot_preemption_figure docs/data/slot_preemption_2026-12-04_load0.7.json \
      docs/data/slot_preemption_2026-12-04.json --out=docs/figures/slot_preemption_2026-12-04.png

The chat/RAG/code mix with chat (short prompts and answers, 60% of the requests) as the important class (priority
0) and rag and code (long prompts or long answers, "long" in the summaries) as priority 1: the long requests hold
most of the slots most of the time. 8 slots and a pool of 1024 pages (16k tokens, far more than 8 sequences ever
hold), so a waiting request never lacks pages, only a slot. `on` lets a chat request that finds every slot taken
preempt the least important running one (the latest-arrived long one) at once; `off` makes it wait for a slot to
free. The summaries' `short_*` columns are the chat class, `long_*` the rest.

On the simulator (the committed llama-tiny CPU profile: deterministic, under a second a run), at 0.9x the capacity
`off` shows offline on the same requests, 10 workload seeds paired between the entries (intervals over the
workloads). Both runs together take about a minute on 2 CPU cores. Every field not set here is base.py's (see the
comments there); docs/policies.md shows the results.
"""

import os

from cbjax.bench.config_files import sibling_config


def get_config():
    c = sibling_config(__file__, "base.py")
    c.run_name = "slot_preemption"  # results/slot_preemption/
    c.policies = ("off", "on")
    c.variants.off = dict(policy="priority")
    c.variants.on = dict(policy="priority")
    # No aging, so the classes stay apart for the whole run; the only difference is the option.
    c.policy_options.off = dict(aging_s=None, preempt_for_slot=False)
    c.policy_options.on = dict(aging_s=None, preempt_for_slot=True)
    c.baseline = "off"
    c.engine.max_num_seqs = 8  # few slots: they run out first
    c.engine.num_pages = 1024  # 16k KV tokens for 8 sequences of at most 1024: pages never run out
    c.engine.runner = "sim"  # the simulator (needs clock = "virtual")
    c.clock = "virtual"
    c.sim.profile = os.path.join(os.path.dirname(os.path.abspath(__file__)), "profiles", "llama-tiny-cpu.json")
    c.seeds = 10  # workload seeds (the simulator's only spread), each run by both entries
    c.workload.num_requests = 1000
    c.workload.request_rate = None
    c.workload.load = 0.9  # of the capacity of `off` (below), measured offline on the same requests
    c.capacity.policy = "off"
    c.workload.tenant_priority = dict(chat=0, code=1, rag=1)  # chat is interactive; lower is more important
    return c
