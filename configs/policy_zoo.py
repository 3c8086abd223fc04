"""The policy zoo: every scheduling policy on the chat/RAG/code mix with Poisson arrivals, on the same engine.

  python -m experiments.compare_policies --config=configs/policy_zoo.py [--config.policies=fcfs,sarathi ...]

llama-tiny (random weights); a KV pool small enough that sequences are preempted under load; tenants chat (the
interactive class, priority 0), code (1) and rag (2). Requests arrive at 1.2x the capacity fcfs showed on the same
requests offline just before (cbjax/bench/capacity.py), so the queue grows until the end: the order a policy
serves it in decides who waits. Each run ends 2 s after the last arrival: what has not finished by then counts as
not completed, so "long done" shows which policies leave the long requests behind. Virtual clock with measured step
times: no idle sleeping, and arrivals are replayed exactly. Every policy runs 5 times, interleaved; the table gives
medians with 95% intervals and paired ratios to fcfs, starred where they exceed the noise (docs/experiments.md).
About 15 minutes on 2 CPU cores (--config.repeats=1: about 3).
Every field not set here is base.py's (see the comments there); docs/policies.md explains the policies.
"""

from cbjax.bench.config_files import sibling_config


def get_config():
    c = sibling_config(__file__, "base.py")
    c.run_name = "policy_zoo"  # results/policy_zoo/
    c.policies = (
        "fcfs",
        "static",
        "time_window",
        "prefill_first",
        "sarathi",
        "priority",
        "three_level",
        "sjf",
        "srpt_oracle",
        "mlfq",
        "fair_share",
        "edf",
        "lpm",
        "residual_sjf",
        "hrrn",
        "slo_aware",
    )
    c.clock = "virtual"  # time advances by each step's measured wall time; never sleeps between arrivals
    c.horizon_after_last_arrival_s = 2.0  # what is unfinished 2 s after the last arrival counts as not completed
    c.repeats = 5  # one run per policy can rank them either way on a shared machine
    c.baseline = "fcfs"
    c.engine.num_pages = 192  # 3072 KV tokens for 32 slots: long requests get preempted under load
    c.engine.enable_prefix_caching = True  # lpm needs it; for the others it makes recompute after preemption cheap
    c.workload.num_requests = 600
    c.workload.request_rate = None
    c.workload.load = 1.2  # of fcfs's offline capacity on this engine: a little more than it sustains
    c.workload.tenant_priority = dict(chat=0, code=1, rag=2)  # chat is interactive; lower is more important
    # Policy options (docs/policies.md). Deadlines for edf by class (priority): chat 1 s, code 10 s, rag 3 s.
    c.policy_options.edf = {"class_slack_s": {"0": 1.0, "1": 10.0, "2": 3.0}}
    c.policy_options.priority = dict(aging_s=5.0)  # one class of priority gained per 5 s of waiting
    c.policy_options.three_level = dict(demote_after=32)  # decoded more than 32 tokens: preemptible pool
    c.policy_options.slo_aware = dict(ttft_slo_s=2.0)  # the TTFT target of c.slo (base.py: 2000 ms)
    return c
