"""The policy zoo on the simulator: 10,000 requests of the chat/RAG/code mix through every policy, step times from
the calibrated llama-tiny profile of this machine (docs/sim.md). The simulated runs take ~50 s at a load average
of ~2.5 on the 2 shared cores, 2.5-6.5 s per entry (docs/sim.md, Speed), plus the results files.

  python -m experiments.compare_policies --config=configs/sim_zoo.py [--config.sim.profile=PROFILE.json]

policy_zoo.py's engine, policies and options, with `engine.runner = "sim"`: the engine's own Scheduler and policy
objects, a SimRunner whose step times come from `sim.profile`. Requests arrive for ~385 s a little faster than fcfs
serves them on this profile (fcfs: ~25/s simulated), so the queue grows under the slower policies. The scheduler
keeps its waiting queue sorted in each built-in policy's order, so a long queue costs little per step. Every field
not set here is policy_zoo.py's, then compare_cpu.py's.
"""

import os

from cbjax.bench.config_files import sibling_config


def get_config():
    c = sibling_config(__file__, "policy_zoo.py")
    c.run_name = "sim_zoo"  # results/sim_zoo/
    c.engine.runner = "sim"  # the simulator (needs clock = "virtual")
    c.clock = "virtual"
    c.sim.profile = os.path.join(os.path.dirname(os.path.abspath(__file__)), "profiles", "llama-tiny-cpu.json")
    c.workload.num_requests = 10_000
    c.workload.request_rate = 26.0  # a little above fcfs's ~25/s on this profile
    c.horizon_s = 390.0  # arrivals at 26/s span ~385 s
    return c
