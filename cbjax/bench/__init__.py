"""The experiment room: everything that measures an engine rather than serving with it. Pure Python + numpy.

requests.py     WorkloadRequest, length classes, default vocabulary bounds, seeded random streams
lengths.py      LengthSpec: fixed / uniform / lognormal token counts
arrivals.py     arrival processes (offline, Poisson, gamma, Weibull, a diurnal cycle, trace replay at any rate)
generators.py   synthetic, the chat/RAG/code mix, shared system prompts, multi-turn sessions
trace_files.py  loaders and writers: JSONL traces, ShareGPT, the peers' JSON
production_traces.py  the Azure LLM inference traces' and BurstGPT's CSV files as workloads
workload.py     make_workload(cfg): the entry point experiments use
fields.py       reading and checking config fields
online.py       the online loop: requests join a running engine as the clock reaches them
run_gc.py       the garbage collector around one run: what exists before it frozen, paused while a simulated one runs
sessions.py     multi-turn sessions in the online loop: a turn is released when the one before it has finished
metrics.py      vLLM's serving metrics (TTFT, TPOT, ITL, E2E, goodput) and per-step engine metrics
intervals.py    medians over repeated runs with bootstrap intervals, paired ratios, significance
capacity.py     load stated relative to capacity: a reference policy's offline capacity, the rate of a load
capacity_search.py  the highest arrival rate a policy sustains under SLOs, by bisection
comparison_table.py  the policy comparison's printed tables
results.py      the results folder: config, manifest, summaries, records
doc_data.py     the data files docs/ tables are generated from (command, commit, CPU, date, every run)
plots.py        throughput, latency CDFs, utilisation (matplotlib, imported on use)
config_files.py loading sibling ml_collections config files
ctrl_c.py       Ctrl-C that ends a run at the next step, keeping what was measured
host_timers.py  the serving thread's CPU time per step, by part (through the engine's and runner's hooks)
"""
