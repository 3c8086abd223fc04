"""bfloat16 vs int8 KV pages on configs/sim_mix_7b.py (Llama-2-7B shapes, the chat/RAG/code mix at full lengths,
offline), static and fcfs, in one run: what int8 pages would buy an accelerator, as the roofline predicts it (a
prediction from data-sheet peaks, not a measurement; docs/sim.md, docs/memory.md).

  python -m experiments.compare_policies --config=configs/sim_mix_7b_kv_int8.py --config.seeds=3
  python -m experiments.compare_policies --config=configs/sim_mix_7b_kv_int8.py --config.seeds=3 \\
      --config.sim.accelerator=tpu-v5e --config.sim.num_chips=4 --config.run_name=sim_mix_7b_kv_int8_v5e

The simulator repeats exactly: `seeds` runs every entry on that many workload seeds (paired, so the int8 / bf16
ratios are per seed). Each entry's pool comes from the accelerator's memory after the weights, in pages of its own
dtype. Every field not set here is sim_mix_7b.py's.
"""

from cbjax.bench.config_files import sibling_config


def get_config():
    c = sibling_config(__file__, "sim_mix_7b.py")
    c.run_name = "sim_mix_7b_kv_int8"  # results/sim_mix_7b_kv_int8/
    c.policies = ("static_bf16", "fcfs_bf16", "static_int8", "fcfs_int8")
    c.variants.static_bf16 = dict(policy="static", kv_cache_dtype="bfloat16")
    c.variants.fcfs_bf16 = dict(policy="fcfs", kv_cache_dtype="bfloat16")
    c.variants.static_int8 = dict(policy="static", kv_cache_dtype="int8")
    c.variants.fcfs_int8 = dict(policy="fcfs", kv_cache_dtype="int8")
    return c
