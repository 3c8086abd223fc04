"""EngineConfig: the engine's options, each checked for type and range when the config is built.

Kept free of jax so the experiment harness can check a whole run's engine options before it writes a file or
compiles anything.
"""

import dataclasses

from cbjax.core import validation as check
from cbjax.core.policies import POLICIES, make_policy
from cbjax.core.speculative_config import SpeculativeConfig
from cbjax.sim.roofline import ACCELERATORS

DTYPES = ("float32", "bfloat16", "float16")
QUANTIZATIONS = ("int8",)  # cbjax.model.quantize.QUANTIZATIONS
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "int8")  # kernels_pallas.kv_quant.KV_CACHE_DTYPES
ATTENTION_BACKENDS = ("auto", "pallas", "xla")  # kernels_pallas.dispatch.BACKENDS
CPU_MATMULS = ("auto", "packed", "xla")  # cbjax.model.linear_impl.CPU_MATMULS
WARMUP_MODES = ("background", "full", "none")  # cbjax.runner.model_runner.WARMUP_MODES
PREEMPTION_MODES = ("recompute", "swap")
RUNNERS = ("model", "sim")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    policy: str = "fcfs"  # scheduling policy: a name in cbjax.core.policies.POLICIES (docs/policies.md)
    policy_options: dict | None = None  # the policy's constructor options, e.g. {"aging_s": 5.0}
    max_num_seqs: int = 64  # slots per step
    max_num_batched_tokens: int = 512  # token budget per step (prefill chunks + decodes)
    page_size: int = 16  # tokens per KV page
    num_pages: int | None = None  # KV pages; None: derived from kv_cache_memory_gib
    kv_cache_memory_gib: float = 1.0  # memory budget of the KV cache when num_pages is None
    max_model_len: int | None = None  # prompt + output tokens; None: the model's max_position_embeddings
    dtype: str | None = None  # parameter / activation dtype; None: the model config's
    matmul_dtype: str | None = None  # the linear layers' weights and matmul inputs (ModelConfig.matmul_dtype)
    # "int8": weight-only int8 linears and LM head, one scale per output channel (cbjax/model/quantize.py); None: off.
    quantization: str | None = None
    # The KV pages' dtype: "auto" (the model's dtype), "float32", "bfloat16", or "int8" (a float32 scale per token
    # and kv head, dequantized inside attention: kernels_pallas/kv_quant.py). kv_cache_memory_gib then holds more pages.
    kv_cache_dtype: str = "auto"
    # The float32 linears on the CPU backend: "auto" / "packed" (a C++ matmul over weights packed at load time,
    # cbjax/model/linear_impl.py) or "xla" (XLA's dot). The CBJAX_MATMUL environment variable overrides it.
    cpu_matmul: str = "auto"
    seed: int = 0  # model init (random models) and the default per-request sampling seeds
    # Tensor parallelism: parameters and KV heads split over this many devices (cbjax/runner/sharding.py).
    tensor_parallel_size: int = 1
    attention_backend: str = "auto"  # auto | pallas | xla (auto: pallas on TPU/GPU, xla on CPU)
    pallas_interpret: bool = False  # run Pallas kernels in interpret mode (CPU tests)
    enable_chunked_prefill: bool = True
    watermark_fraction: float = 0.01  # fraction of the pages kept free at admission, so running sequences can grow
    static_batch_timeout_s: float = 0.0  # static: wait for a full batch or this long (0: start with what waits)
    preemption_mode: str = "recompute"  # recompute: drop a victim's KV | swap: move it to host memory and back
    swap_space_gib: float = 1.0  # swap: host memory for swapped-out KV pages (a victim that does not fit recomputes)
    num_host_pages: int | None = None  # swap: host pool in pages; None: derived from swap_space_gib
    enable_prefix_caching: bool = False  # share the KV pages of identical prompt prefixes (vLLM's option)
    # Sliding-window models (Mistral's sliding_window): free the KV pages no query can read any more, so a long
    # sequence holds about window / page_size + 1 pages. False keeps every page (to measure what eviction saves).
    evict_outside_window: bool = True
    # When the step programs (one per token bucket) are built: "background" (start serving at once; a background
    # thread builds them, smallest first, and a step whose program is missing builds it itself), "full" (all
    # before the constructor returns: time nothing before that), "none" (each when first needed). True is "full",
    # False "none".
    warmup: bool | str = "background"
    # Persistent compilation cache (cbjax/runner/compile_cache.py): "auto" (a folder in the user's cache
    # directory), "off", or a directory. The CBJAX_COMPILATION_CACHE environment variable overrides it.
    compilation_cache: str = "auto"
    # Schedule and start step n+1 before the results of step n reach the host (its sampled tokens are fed to step
    # n+1 on the device), so host work overlaps the device's. False: one step at a time.
    async_scheduling: bool = True
    # Up to this many decode steps per dispatch, where that changes no scheduling decision (nothing waits, every
    # running sequence decodes): the host's work is paid once per block (cbjax/core/multi_step.py, vLLM's option of
    # the same name). Tokens then reach the host, and stream, a block at a time; 1: one step per dispatch.
    num_scheduler_steps: int = 1
    # "model": the real model on this machine. "sim": the simulator (cbjax.sim, docs/sim.md): the same scheduler
    # and policies, step times from a cost model, a virtual clock, no weights and no compile.
    runner: str = "model"
    sim_profile: str | None = None  # sim: a cost-model profile (JSON, e.g. from experiments/calibrate.py)
    sim_accelerator: str | None = None  # sim without a profile: the roofline of this accelerator (cbjax.sim.roofline)
    sim_num_chips: int = 1  # sim_accelerator: chips in tensor parallel (communication taken as free)
    # sim: every step's time times this (cbjax.sim.ScaledCost): a slower (> 1) or faster machine, or how much a
    # result moves with the cost model's error.
    sim_step_time_scale: float = 1.0
    # Speculative decoding (cbjax/core/speculative_config.py, docs/speculative.md): None (off), or a dict such as
    # {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}.
    speculative_config: SpeculativeConfig | dict | None = None

    def __post_init__(self):
        """Check every option (ValueError naming it, its value and what is allowed) and store plain Python values.

        The policy's own options are checked by building the policy once (its constructor checks them)."""
        normal = dict(
            policy=check.choice("policy", self.policy, sorted(POLICIES)),
            policy_options=check.mapping("policy_options", self.policy_options) or None,
            max_num_seqs=check.integer("max_num_seqs", self.max_num_seqs, 1),
            max_num_batched_tokens=check.integer("max_num_batched_tokens", self.max_num_batched_tokens, 1),
            page_size=check.integer("page_size", self.page_size, 1),
            num_pages=check.optional_integer("num_pages", self.num_pages, 1),
            kv_cache_memory_gib=check.real("kv_cache_memory_gib", self.kv_cache_memory_gib, 0.0, low_open=True),
            max_model_len=check.optional_integer("max_model_len", self.max_model_len, 1),
            dtype=check.choice("dtype", self.dtype, (None, *DTYPES)),
            matmul_dtype=check.choice("matmul_dtype", self.matmul_dtype, (None, *DTYPES)),
            quantization=check.choice("quantization", self.quantization, (None, *QUANTIZATIONS)),
            kv_cache_dtype=check.choice("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES),
            cpu_matmul=check.choice("cpu_matmul", self.cpu_matmul, CPU_MATMULS),
            seed=check.integer("seed", self.seed, 0, 2**32 - 1),
            tensor_parallel_size=check.integer("tensor_parallel_size", self.tensor_parallel_size, 1),
            attention_backend=check.choice("attention_backend", self.attention_backend, ATTENTION_BACKENDS),
            pallas_interpret=check.boolean("pallas_interpret", self.pallas_interpret),
            enable_chunked_prefill=check.boolean("enable_chunked_prefill", self.enable_chunked_prefill),
            watermark_fraction=check.real("watermark_fraction", self.watermark_fraction, 0.0, 1.0, high_open=True),
            static_batch_timeout_s=check.real("static_batch_timeout_s", self.static_batch_timeout_s, 0.0),
            preemption_mode=check.choice("preemption_mode", self.preemption_mode, PREEMPTION_MODES),
            swap_space_gib=check.real("swap_space_gib", self.swap_space_gib, 0.0),
            num_host_pages=check.optional_integer("num_host_pages", self.num_host_pages, 0),
            enable_prefix_caching=check.boolean("enable_prefix_caching", self.enable_prefix_caching),
            evict_outside_window=check.boolean("evict_outside_window", self.evict_outside_window),
            warmup=check.choice("warmup", self.warmup, (True, False, *WARMUP_MODES)),
            compilation_cache=check.text("compilation_cache ('auto', 'off' or a directory)", self.compilation_cache),
            async_scheduling=check.boolean("async_scheduling", self.async_scheduling),
            num_scheduler_steps=check.integer("num_scheduler_steps", self.num_scheduler_steps, 1),
            runner=check.choice("runner", self.runner, RUNNERS),
            sim_profile=None if self.sim_profile is None else check.text("sim_profile", self.sim_profile),
            sim_accelerator=check.choice("sim_accelerator", self.sim_accelerator, (None, *ACCELERATORS)),
            sim_num_chips=check.integer("sim_num_chips", self.sim_num_chips, 1),
            sim_step_time_scale=check.real("sim_step_time_scale", self.sim_step_time_scale, 0.0, low_open=True),
            speculative_config=SpeculativeConfig.from_option(self.speculative_config),
        )
        for name, value in normal.items():
            object.__setattr__(self, name, value)
        make_policy(self.policy, self.policy_options)  # its options' names, types and ranges (a cheap object)
        if self.sim_profile is not None and self.sim_accelerator is not None:
            raise ValueError(
                f"sim_profile ({self.sim_profile!r}) and sim_accelerator ({self.sim_accelerator!r}) both set; "
                "a simulation takes its step times from one of them"
            )
        if self.speculative_config is not None and self.runner == "sim":
            raise ValueError("speculative_config is not supported by the simulator (runner='sim') yet")
        spec = self.speculative_config
        if spec is not None and spec.method == "draft" and self.tensor_parallel_size > 1:
            raise ValueError("speculative_config.method='draft' with tensor_parallel_size > 1 is not supported yet")

    @classmethod
    def from_options(cls, options: dict) -> "EngineConfig":
        """EngineConfig(**options), with a ValueError (not a TypeError) for a keyword that is not an option."""
        unknown = set(options) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"unknown engine options: {sorted(map(str, unknown))}")
        return cls(**options)
