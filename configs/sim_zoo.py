"""The policy zoo on the simulator: 10,000 requests of the chat/RAG/code mix through every policy, step times from
the committed llama-tiny CPU profile (configs/profiles/llama-tiny-cpu.json; docs/sim.md). Each entry's simulated
run takes a few seconds on 2 CPU cores (docs/sim.md, Speed), plus the capacity run and the results files.

  python -m experiments.compare_policies --config=configs/sim_zoo.py [--config.sim.profile=PROFILE.json]
  python -m experiments.compare_policies --config=configs/sim_zoo.py --config.sim.profile=auto   # this machine, now

policy_zoo.py's engine, policies and options, with `engine.runner = "sim"`: the engine's own Scheduler and policy
objects, a SimRunner whose step times come from `sim.profile`. The committed profile makes the run the same on
every machine (the simulator is deterministic); the engine warns when that profile was made on another CPU, jax or
version of the step's code. `auto` calibrates this machine's profile instead (1-2 minutes the first time, then
cached). As in policy_zoo.py, requests arrive at 1.2x the capacity fcfs shows on the same requests offline (here
on the simulator, so on whichever profile runs), so the queue grows under the slower policies, and each run ends 2 s
after the last arrival. The scheduler keeps its waiting queue sorted in each built-in policy's order, so a long
queue costs little per step. Every field not set here is policy_zoo.py's, then base.py's.
"""

import os

from cbjax.bench.config_files import sibling_config


def get_config():
    c = sibling_config(__file__, "policy_zoo.py")
    c.run_name = "sim_zoo"  # results/sim_zoo/
    c.engine.runner = "sim"  # the simulator (needs clock = "virtual")
    c.clock = "virtual"
    c.sim.profile = os.path.join(os.path.dirname(os.path.abspath(__file__)), "profiles", "llama-tiny-cpu.json")
    c.repeats = 1  # the simulator is deterministic: policy_zoo's 5 repeats would be 5 identical runs
    c.workload.num_requests = 10_000
    return c
