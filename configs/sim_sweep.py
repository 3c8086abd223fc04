"""Latency against load on the simulator: the chat/RAG/code mix at a range of arrival rates, for a few policies;
the classic curves (TTFT, TPOT and E2E percentiles against the offered rate).

  python -m experiments.sim_sweep --config=configs/sim_sweep.py [--config.sweep.rates=10,20,40 ...]

Every field not set here is sim_zoo.py's (the committed llama-tiny profile, or --config.sim.profile=auto), then
policy_zoo.py's and base.py's. The rates were chosen on the profile of 2026-12-01, on which fcfs saturated at
~25 req/s; on the one recalibrated on 2026-12-04 it sustains about twice that, so only the top rate passes it
(docs/sim.md marks the sweep's figures stale until the rates are chosen again).
"""

import ml_collections

from cbjax.bench.config_files import sibling_config


def get_config():
    c = sibling_config(__file__, "sim_zoo.py")
    c.run_name = "sim_sweep"  # results/sim_sweep/
    c.policies = ("fcfs", "static", "sarathi", "priority", "mlfq")
    c.policy_options = ml_collections.ConfigDict(dict(priority=c.policy_options.priority.to_dict()))  # zoo's aging
    c.workload.num_requests = 2000
    # Arrivals span 2000 / rate seconds (200 s at 10/s); static drains 60/s of arrivals by ~180 s. mlfq thrashes
    # from 20/s on (docs/sim.md) and would take hours of simulated time to finish 2000 requests: at 600 s the run
    # is cut, and what has not finished counts as not completed (num_completed in sweep.csv).
    c.horizon_s = 600.0
    c.horizon_after_last_arrival_s = None  # the zoo's; here every rate's run ends at horizon_s
    c.sweep = dict(rates=(10.0, 20.0, 30.0, 40.0, 50.0, 60.0))  # requests per second
    return c
