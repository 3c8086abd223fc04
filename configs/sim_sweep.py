"""Latency against load on the simulator: the chat/RAG/code mix at a range of loads, for a few policies; the classic
curves (TTFT, TPOT and E2E percentiles against the offered load).

  python -m experiments.sim_sweep --config=configs/sim_sweep.py [--config.sweep.loads=0.5,1,1.5 ...]

A load is a fraction of fcfs's capacity on the sweep's requests, measured on the simulator before the sweep
(docs/experiments.md, "Load relative to capacity"), so the points stay below, at and above saturation on any
profile (the committed one, --config.sim.profile=auto, an accelerator). Every field not set here is sim_zoo.py's
(the committed llama-tiny profile), then policy_zoo.py's and base.py's.
"""

import ml_collections

from cbjax.bench.config_files import sibling_config


def get_config():
    c = sibling_config(__file__, "sim_zoo.py")
    c.run_name = "sim_sweep"  # results/sim_sweep/
    c.policies = ("fcfs", "static", "sarathi", "priority", "mlfq")
    c.policy_options = ml_collections.ConfigDict(dict(priority=c.policy_options.priority.to_dict()))  # zoo's aging
    c.workload.num_requests = 2000
    c.seeds = 3  # every point on workload seeds seed, +1, +2: medians with intervals over the workload's randomness
    # mlfq thrashes under sustained load (docs/sim.md) and would take hours of simulated time to finish 2000
    # requests: at 600 s the run is cut, and what has not finished counts as not completed (num_completed).
    c.horizon_s = 600.0
    c.horizon_after_last_arrival_s = None  # the zoo's; here every point's run ends at horizon_s
    # Fractions of fcfs's offline capacity (sweep.rates: absolute requests/s instead; set one of the two).
    c.sweep = dict(loads=(0.5, 0.8, 0.9, 1.0, 1.2), rates=())
    return c
