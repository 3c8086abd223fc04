"""The main job: static vs client-side time windows vs continuous batching, online, at 0.9 of fcfs's capacity.

  python -m experiments.compare_policies --config=configs/compare_cpu.py [--config.workload.load=0.8 ...]

llama-tiny (random weights, no download); 600 requests of the chat/RAG/code mix scaled down 8x. The arrival rate is
a load: before the runs, fcfs serves the same requests offline on the same engine (3 times; the median counts), and
the requests then arrive (Poisson) at 0.9 of the rate it sustained. So on any machine continuous batching keeps up
and static batching, whose batches wait for their longest member, falls behind: the regime this comparison exists
to show, whatever the machine's speed. About 1.5 minutes on 2 CPU cores, compiles included.
Every field not set here is base.py's (see the comments there).
"""

from cbjax.bench.config_files import sibling_config


def get_config():
    c = sibling_config(__file__, "base.py")
    c.run_name = "compare_cpu"  # results/compare_cpu/
    # 16 slots: on 2 CPU cores a step's cost grows with its rows, and 16 slots already sustain what 32 do (fcfs
    # ~66 req/s offline either way, 2026-12-04), while a static batch of 16 still waits on its longest member.
    c.engine.max_num_seqs = 16
    c.time_window.max_batch = 16  # the client's batches are the engine's batches
    c.workload.num_requests = 600  # enough that the last arrivals' drain is a small part of each run
    c.workload.request_rate = None  # the rate is the load's:
    # Of fcfs's offline capacity, measured on this machine before the runs: fcfs keeps up, and its output throughput
    # stays within ~10% of 0.9 x capacity (the last arrivals' drain), while static sustains about half of fcfs's
    # capacity with 16 slots here (33-37 req/s against 60-75).
    c.workload.load = 0.9
    c.capacity.runs = 3  # the median of 3 offline runs: one slow or fast minute does not set the rate
    return c
