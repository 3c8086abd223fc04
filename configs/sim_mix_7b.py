"""Continuous vs static batching on the chat/RAG/code mix at full lengths (60% chat / 25% RAG / 15% code), as the
roofline predicts it for a llama-7B-class model on an H200 (or, with an override, a TPU v5e slice). A
prediction from data-sheet peaks, not a measurement (cbjax/sim/roofline.py; docs/sim.md).

  python -m experiments.compare_policies --config=configs/sim_mix_7b.py
  python -m experiments.compare_policies --config=configs/sim_mix_7b.py --config.sim.accelerator=tpu-v5e \\
      --config.sim.num_chips=4 --config.run_name=sim_mix_7b_v5e

Offline (all requests at t=0), as configs/compare_mixed.py does on the CPU, so the ratio is the engines' and not
the arrival rate's. A single v5e chip (16 GB) holds the 13.5 GB of bf16 weights with room for ~1.7k KV tokens,
less than one long request: the v5e run takes 4 chips (tensor parallel, communication taken as free). Every field
not set here is base.py's.
"""

from cbjax.bench.config_files import sibling_config


def get_config():
    c = sibling_config(__file__, "base.py")
    c.run_name = "sim_mix_7b"  # results/sim_mix_7b/
    c.model = "llama-7b"  # Llama-2-7B shapes (cbjax/model/config.py); no weights are built
    c.policies = ("static", "fcfs")
    c.clock = "virtual"
    c.engine.runner = "sim"
    c.sim.accelerator = "h200"
    c.engine.dtype = "bfloat16"
    c.engine.max_num_seqs = 256  # slots per step (also the static batch size)
    c.engine.max_num_batched_tokens = 2048  # token budget per step
    c.engine.num_pages = None  # from the accelerator's memory after the weights (90% of HBM)
    c.engine.max_model_len = 4096  # Llama-2's context; the mix is clipped to it
    c.engine.static_batch_timeout_s = 0.0  # offline: a static batch starts with whatever waits
    c.workload.arrival = "offline"
    c.workload.num_requests = 2560  # 10 static batches of 256
    c.workload.scale = 1.0  # full lengths
    c.slo.tpot_ms = 50.0
    return c
