"""Capacity under SLOs for the policy zoo, searched on the simulator (experiments/capacity.py):

  python -m experiments.capacity --config=configs/capacity_zoo.py                    # ~2-4 min on 2 cores
  python -m experiments.capacity --config=configs/capacity_zoo.py --config.capacity_search.real_check=True \
      [--config.capacity_search.real_policies=fcfs,static,sjf]

sim_zoo.py's engine, policies and profile (the committed llama-tiny CPU profile; `--config.sim.profile=auto` for
this machine's), 1000 requests of the chat/RAG/code mix, Poisson arrivals at the rate being tried, every request to
its end. SLOs: TTFT 1 s and TPOT 50 ms, met by at least 90% of the requests. Three workload seeds, each searched on
its own (the interval of the capacity is over seeds). The real check runs llama-tiny at the capacity and 1.1x it,
3 times each (about 1 minute per policy and repeat).
"""

import ml_collections
from ml_collections import config_dict

from cbjax.bench.config_files import sibling_config


def get_config():
    c = sibling_config(__file__, "sim_zoo.py")
    c.run_name = "capacity_zoo"  # results/capacity_zoo/
    c.workload.num_requests = 1000
    c.workload.load = 0.0  # off: the search sets the rate
    c.horizon_after_last_arrival_s = None  # every request runs to its end: attainment counts them all
    c.seeds = 3
    c.repeats = 3  # the real check's runs at each rate
    c.baseline = None
    c.slo.ttft_ms = 1000.0
    c.slo.tpot_ms = 50.0
    s = c.capacity_search = ml_collections.ConfigDict()
    s.target = 0.9  # the share of requests within every SLO
    s.tolerance = 0.02  # stop when the bracket is this fraction of the rate wide
    s.max_probes = 16  # runs per search at most
    s.real_check = False  # then run the real engine at the found rate and real_factor x it
    s.real_factor = 1.1
    s.real_policies = config_dict.placeholder(str)  # the policies to check (comma-separated); None: every one
    return c
