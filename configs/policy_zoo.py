"""The policy zoo: every scheduling policy on the chat/RAG/code mix with Poisson arrivals, on the same engine.

  python -m experiments.compare_policies --config=configs/policy_zoo.py [--config.policies=fcfs,sarathi ...]

llama-tiny (random weights); a KV pool small enough that sequences are preempted under load; tenants chat (the
interactive class, priority 0), code (1) and rag (2). Requests arrive for 10 s a little faster than fcfs serves
them on 2 CPU cores, so the queue grows until the end: the order a policy serves it in decides who waits. Each run
ends at `horizon_s`, 2 s after the last arrival: what has not finished by then counts as not completed, so
"long done" shows which policies leave the long requests behind. Virtual clock with measured step times: no idle
sleeping, and arrivals are replayed exactly. About 4 minutes on 2 CPU cores.
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
    )
    c.clock = "virtual"  # time advances by each step's measured wall time; never sleeps between arrivals
    c.horizon_s = 12.0  # arrivals span ~10 s; what is unfinished at 12 s counts as not completed
    c.engine.num_pages = 192  # 3072 KV tokens for 32 slots: long requests get preempted under load
    c.engine.enable_prefix_caching = True  # lpm needs it; for the others it makes recompute after preemption cheap
    c.workload.num_requests = 600
    c.workload.request_rate = 60.0  # a little above what fcfs sustains (~50/s): the queue grows to the end
    c.workload.tenant_priority = dict(chat=0, code=1, rag=2)  # chat is interactive; lower is more important
    # Policy options (docs/policies.md). Deadlines for edf by class (priority): chat 1 s, code 10 s, rag 3 s.
    c.policy_options.edf = {"class_slack_s": {"0": 1.0, "1": 10.0, "2": 3.0}}
    c.policy_options.priority = dict(aging_s=5.0)  # one class of priority gained per 5 s of waiting
    c.policy_options.three_level = dict(demote_after=32)  # decoded more than 32 tokens: preemptible pool
    return c
