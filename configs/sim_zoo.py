"""The policy zoo on the simulator: 10,000 requests of the chat/RAG/code mix through every policy in about a
minute, step times from the calibrated llama-tiny profile of this machine (docs/sim.md).

  python -m experiments.compare_policies --config=configs/sim_zoo.py [--config.sim.profile=PROFILE.json]

policy_zoo.py's engine, policies and options, with `engine.runner = "sim"`: the engine's own Scheduler and policy
objects, a SimRunner whose step times come from `sim.profile`. Requests arrive for ~170 s a little faster than fcfs
serves them (as in policy_zoo.py); the run ends 3 s after the last arrival. Every field not set here is
policy_zoo.py's, then compare_cpu.py's.
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
    c.horizon_s = 170.0  # arrivals at 60/s span ~167 s
    return c
