"""The fields every experiment config has, with their defaults and what each means: the config files of configs/
start from this one (cbjax.bench.config_files.sibling_config) and set what they change.

  python -m experiments.compare_policies --config=configs/base.py   # runs as it stands: 32 slots, 36 req/s

llama-tiny (random weights, no download); the chat/RAG/code mix scaled down 8x; Poisson arrivals at an absolute
rate. The main job (configs/compare_cpu.py) states its rate as a load relative to the measured capacity instead.
"""

import ml_collections
from ml_collections import config_dict


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.model = "llama-tiny"  # named model config (cbjax/model/config.py), the same weights for every policy
    c.policies = ("static", "time_window", "fcfs")  # the rows of the table; --config.policies=fcfs,static
    c.run_name = "base"  # results go to <output_dir>/<run_name>/
    c.output_dir = "results"  # parent folder of the run folders
    # Also write a data file for the docs here (cbjax/bench/doc_data.py; docs/data/NAME.json): every run's metrics,
    # the command, commit and CPU, from which `python -m experiments.doc_tables` makes the docs' tables.
    c.doc_data = config_dict.placeholder(str)
    c.overwrite = False  # True: replace an earlier run of this run_name; False: write to <run_name>_2, _3, ...
    c.clock = "real"  # real: wall clock, sleeps between arrivals | virtual: simulated time, never sleeps
    c.step_cost_ms = 0.0  # virtual clock: fixed cost of every step; 0: each step's measured wall time

    c.horizon_s = config_dict.placeholder(float)  # end each run here (s); unfinished requests count as not completed
    # Or end each run this long after the workload's last arrival (s): the same share of the run on any machine when
    # a load sets the arrival span. With horizon_s too, the earlier of the two.
    c.horizon_after_last_arrival_s = config_dict.placeholder(float)
    # Runs of every policy, interleaved (repeat r starts r entries later). > 1: the table's metrics become medians over
    # the repeats with 95% bootstrap intervals (cbjax/bench/intervals.py), and every repeat's records are written.
    # (On the simulator a repeat is an exact copy: give it `seeds` instead.)
    c.repeats = 1
    # With repeats: an entry of `policies` every other entry is compared with, repeat by repeat (paired ratios with
    # intervals; a ratio whose interval excludes 1 is starred as a difference larger than the noise).
    c.baseline = config_dict.placeholder(str)
    # Workload seeds: every repeat runs on workload.seed, workload.seed + 1, ... (repeats x seeds runs of each policy,
    # paired by run), so the intervals also cover the workload's randomness: the simulator's only spread.
    c.seeds = 1
    # Per-entry constructor options of the policy, e.g. c.policy_options.priority = dict(aging_s=5.0)
    # (docs/policies.md lists each policy's options).
    c.policy_options = ml_collections.ConfigDict()
    # Named engine variants usable as entries of `policies`: label -> dict(policy=NAME, engine overrides...),
    # e.g. c.variants.fcfs_swap = dict(policy="fcfs", preemption_mode="swap").
    c.variants = ml_collections.ConfigDict()

    # Engine options: EngineConfig's flat options (cbjax/engine_config.py). Each entry of `policies` sets the policy.
    e = c.engine = ml_collections.ConfigDict()
    e.policy = config_dict.placeholder(str)  # set (--config.engine.policy=sjf) to run this one policy alone
    e.max_num_seqs = 32  # slots per step (also the static batch size)
    e.max_num_batched_tokens = 256  # token budget per step; the largest token bucket
    e.page_size = 16  # tokens per KV page
    e.num_pages = 1024  # KV pages in the pool (None: from kv_cache_memory_gib)
    e.kv_cache_memory_gib = 1.0  # KV budget when num_pages is None
    e.max_model_len = 1024  # prompt + output tokens of one request; the workload is clipped to it
    e.dtype = "float32"  # parameters and activations: float32 | bfloat16
    e.matmul_dtype = config_dict.placeholder(str)  # linear layers' weights and matmul inputs (None: dtype)
    e.kv_cache_dtype = "auto"  # KV pages: auto (= dtype) | float32 | bfloat16 | int8 (docs/memory.md)
    e.seed = 0  # model init and per-request sampling seeds
    e.attention_backend = "auto"  # auto | pallas | xla (auto: xla on CPU)
    e.pallas_interpret = False  # Pallas kernels in interpret mode (CPU debugging only: slow)
    e.enable_chunked_prefill = True  # split long prompts over steps under the token budget
    e.watermark_fraction = 0.01  # fraction of pages kept free at admission so running sequences can grow
    e.static_batch_timeout_s = 0.5  # static: start a batch when full or when its oldest request waited this long
    e.preemption_mode = "recompute"  # recompute: drop a victim's KV | swap: move it to host memory and back
    e.swap_space_gib = 1.0  # swap: host memory for swapped-out KV pages
    e.enable_prefix_caching = False  # reuse the KV pages of identical prompt prefixes
    e.warmup = True  # compile every token bucket before the run, so no compile is timed
    e.async_scheduling = True  # schedule and start step n+1 while step n runs
    # Decode steps per dispatch where nothing waits (cbjax/core/multi_step.py). Above 1, on the CPU a block's rows
    # still reach the host step by step and a request that arrives ends the block after its running step. The host's
    # share drops where long decodes run and few requests arrive; in this job's regime blocks bought little and raised
    # TTFT (docs/benchmarks.md, "Blocks online: where they stand"). Policies that charge each step (vtc, mlfq) run
    # their blocks to the end, and the simulator's blocks never end early.
    e.num_scheduler_steps = 1
    e.compilation_cache = "auto"  # persistent compilation cache: auto (user cache dir) | off | a directory
    e.runner = "model"  # model: the real engine on this machine | sim: the simulator (docs/sim.md; needs c.sim)
    # Speculative decoding (docs/speculative.md), off while method is None:
    # --config.engine.speculative_config.method=ngram
    sd = e.speculative_config = ml_collections.ConfigDict()
    sd.method = config_dict.placeholder(str)  # None (off) | ngram (prompt lookup) | draft (a draft model)
    sd.draft_model = config_dict.placeholder(str)  # draft: its name or checkpoint directory, e.g. tinypy-draft
    sd.num_speculative_tokens = 4  # k: the most drafts a sequence verifies per step
    sd.prompt_lookup_min = 2  # ngram: shortest suffix n-gram matched
    sd.prompt_lookup_max = 4  # ngram: longest suffix n-gram matched (tried first)
    sd.draft_length = "fixed"  # fixed (k) | batch_size (draft_length_table) | measured (acceptance x step cost)
    sd.draft_length_table = config_dict.placeholder(dict)  # batch_size: {"1-8": 4, "9-32": 2, "33-": 0}
    sd.acceptance = "auto"  # auto | rejection_sampling (draft only) | sample_and_match (docs/speculative.md)

    # The simulator (engine.runner = "sim" only; needs clock = "virtual"): step times from one of these.
    sim = c.sim = ml_collections.ConfigDict()
    sim.profile = config_dict.placeholder(str)  # a cost-model profile (JSON) from python -m experiments.calibrate
    sim.accelerator = config_dict.placeholder(str)  # or the roofline of: h100 | h200 | tpu-v5e | tpu-v6e
    sim.num_chips = 1  # accelerator: chips in tensor parallel (communication taken as free)
    sim.step_time_scale = 1.0  # every step's time times this: a slower (> 1) or faster machine

    # Client-side batching for the `time_window` entry (its engine runs policy static with timeout 0).
    tw = c.time_window = ml_collections.ConfigDict()
    tw.window_ms = 500.0  # hold arrivals this long after the first one held ...
    tw.max_batch = 32  # ... or until this many are held; then submit them together

    # Workload: the fields of cbjax.bench.workload.make_workload.
    w = c.workload = ml_collections.ConfigDict()
    # synthetic | mixed (chat/RAG/code) | shared_prefix | jsonl | sharegpt | peers_json | azure_llm | burstgpt
    w.kind = "mixed"
    w.num_requests = 300  # requests (for files: the first N; None: all)
    w.seed = 0  # the same requests for every policy
    w.arrival = "poisson"  # offline (all at t=0) | poisson | gamma | weibull | trace
    # Requests per second (poisson, gamma, weibull), an absolute rate: what regime it makes depends on the machine.
    w.request_rate = config_dict.FieldReference(36.0, field_type=float)  # (None allowed: see load)
    # Or the rate as a load (poisson, gamma, weibull; a replayed trace through trace_rate): that fraction of the
    # capacity of `capacity.policy`, measured offline on these requests, on the same engine, before the runs
    # (cbjax/bench/capacity.py). < 1: that policy keeps up; > 1: its queue grows to the end. The capacity and the
    # rate go in the manifest and the header.
    w.load = config_dict.placeholder(float)
    w.burstiness = 1.0  # gamma or weibull shape: < 1 burstier, 1 = poisson
    # poisson/gamma/weibull: a cycling rate, request_rate * (1 + amplitude * sin(2 pi t / period))
    w.diurnal_period_s = config_dict.placeholder(float)
    w.diurnal_amplitude = 0.0
    w.trace_rate = config_dict.placeholder(float)  # arrival=trace: replay compressed/stretched to this mean rate
    w.trace_models = config_dict.placeholder(str)  # burstgpt: keep these models' rows (comma-separated)
    w.trace_log_types = config_dict.placeholder(str)  # burstgpt: keep these log types' rows (comma-separated)
    w.scale = 0.125  # multiplies every generated length, and a production trace's (sized for a GPU)
    w.vocab_size = config_dict.placeholder(int)  # token ids below this; None: the model's vocabulary
    w.low_id = 3  # smallest generated token id (0..2 are pad/bos/eos)
    w.prompt_len = config_dict.placeholder(int)  # synthetic/shared_prefix: prompt tokens (an int = fixed)
    w.output_len = config_dict.placeholder(int)  # synthetic/shared_prefix: max_tokens (an int = fixed)
    w.num_prefixes = config_dict.placeholder(int)  # shared_prefix: distinct system prompts
    w.prefix_len = config_dict.placeholder(int)  # shared_prefix: tokens per system prompt
    w.tenant_per_prefix = False  # shared_prefix: one tenant per system prompt
    w.path = config_dict.placeholder(str)  # workload file (jsonl, sharegpt, peers_json, azure_llm, burstgpt) or times
    w.max_model_len = config_dict.placeholder(int)  # clip prompt + output to this; None: engine.max_model_len
    w.long_threshold = 1024  # unlabelled requests are "long" above this many prompt + output tokens
    w.deadline_s = config_dict.placeholder(float)  # optional per-request deadline after arrival

    # The reference of workload.load: its policy (an entry name, like those of `policies`) and its offline runs
    # (the capacity is their median).
    cap = c.capacity = ml_collections.ConfigDict()
    cap.policy = "fcfs"
    cap.runs = 1

    # SLOs for goodput (requests meeting every bound per second); None: not checked.
    s = c.slo = ml_collections.ConfigDict()
    s.ttft_ms = 2000.0  # time to first token, queueing included
    s.tpot_ms = 100.0  # time per output token after the first
    s.e2e_ms = config_dict.placeholder(float)  # end to end
    return c
