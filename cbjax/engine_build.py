"""Building an engine, in the order it happens: the model (or, for the simulator, its shapes), the sizes that depend
on it and on the machine (max_model_len, KV pages, host swap pages), the bucket table, the scheduler, the runner, its
warmup. LLMEngine's constructor calls `build_engine` and keeps what it returns; each step is a named function so
that the order is visible and each piece can be built alone (tests, tools).
"""

import dataclasses
import os

from cbjax import sim_calibration
from cbjax.core.clock import Clock, RealClock, VirtualClock
from cbjax.core.runner_contract import Runner
from cbjax.core.scheduler import Scheduler
from cbjax.core.speculation.speculator import Speculator
from cbjax.engine_config import EngineConfig
from cbjax.memory_fit import check_fits, device_memory_bytes, host_memory_bytes
from cbjax.model.config import ModelConfig, get_model_config
from cbjax.model.hf_loader import load_hf_model
from cbjax.model.linear_impl import serving_model
from cbjax.model.llama import Llama, init_model, kv_cache_bytes_per_page
from cbjax.model.registry import model_config_of, resolve_checkpoint
from cbjax.model.tokenizer import Tokenizer
from cbjax.runner.build import build_model_runner
from cbjax.runner.compilation.jax_cache import configure_compilation_cache
from cbjax.runner.speculation.draft_model import check_draft_model, draft_config
from cbjax.runner.step_input import BucketTable
from cbjax.sim import SimRunner, engine_cost_model


@dataclasses.dataclass
class EngineParts:
    """What an LLMEngine is made of."""

    config: EngineConfig  # resolved: num_pages, num_host_pages and max_model_len are set
    clock: Clock
    model: Llama | None  # None for the simulator (no weights)
    model_config: ModelConfig
    tokenizer: Tokenizer | None
    buckets: BucketTable
    scheduler: Scheduler
    runner: Runner
    compilation_cache_dir: str | None
    warmup_s: float


def build_engine(model, config: EngineConfig, *, clock=None, device=None, cost_model=None) -> EngineParts:
    """Every part of an engine for `model` (anything LLMEngine takes) and `config`, in order."""
    spec, sim = config.speculative, config.sim.enabled
    if spec is not None and spec.draft_model is not None:
        check_draft_model(model, spec.draft_model, config.scheduler.max_model_len)
    if sim:  # the simulator: no weights, no compile; the model's shapes only (docs/sim.md)
        clock = VirtualClock() if clock is None else clock
        cache_dir, built = None, None
        mcfg, tokenizer = model_shapes(model, config)
        # sim_profile="auto" calibrates on the real engine when this machine has no cached profile for the setup.
        cost_model = engine_cost_model(config, mcfg, cost_model, calibrate=sim_calibration.calibrate)
    else:
        if cost_model is not None:
            raise ValueError("cost_model is for runner='sim' only")
        clock = RealClock() if clock is None else clock
        cache_dir = configure_compilation_cache(config.compilation.compilation_cache)  # first: loading may compile
        built, tokenizer = load_model(model, config)
        mcfg = built.cfg
    config = resolve_sizes(config, mcfg, kv_pages_of=getattr(cost_model, "kv_pages", None))
    k = 0 if spec is None else spec.num_speculative_tokens  # drafts verified per sequence and step, at most
    buckets = BucketTable.from_config(config.scheduler, config.cache, max_draft_tokens=k)
    # Built before the runner so a bad policy option fails before any compile.
    scheduler = Scheduler(
        config.scheduler,
        config.cache,
        clock,
        sliding_window=mcfg.sliding_window,
        speculator=None if spec is None else Speculator(spec),
    )
    if sim:
        runner = sim_runner(config, mcfg, cost_model, clock, buckets)
    else:
        runner = build_model_runner(
            built,
            cache=config.cache,
            compilation=config.compilation,
            parallel=config.parallel,
            speculative=spec,
            num_scheduler_steps=config.scheduler.num_scheduler_steps,
            buckets=buckets,
            device=device,
            program_store_dir=None if cache_dir is None else os.path.join(cache_dir, "cbjax-programs"),
            dtype=config.load.dtype,
            matmul_dtype=config.load.matmul_dtype,
        )
    warmup_s = runner.warmup(config.compilation.warmup_mode)
    return EngineParts(config, clock, built, mcfg, tokenizer, buckets, scheduler, runner, cache_dir, warmup_s)


def load_model(model, config: EngineConfig) -> "tuple[Llama, Tokenizer | None]":
    """The model with its weights, as it will serve (int8, packed for the CPU matmul, or as is), and its tokenizer."""
    load, tp = config.load, config.parallel.tensor_parallel_size
    tokenizer = None
    if not isinstance(model, Llama):
        sharded = tp > 1  # the runner places each shard on its device straight from the host
        checkpoint = resolve_checkpoint(model)
        if checkpoint is not None:
            path, default_dtype = checkpoint
            tokenizer = Tokenizer.from_dir(path)
            model = load_hf_model(path, load.dtype or default_dtype, load.matmul_dtype, on_host=sharded)
        else:
            mcfg = get_model_config(model) if isinstance(model, str) else model
            if not isinstance(mcfg, ModelConfig):
                raise ValueError(f"model must be a name, a ModelConfig or a Llama, got {type(model).__name__}")
            model = init_model(with_dtypes(mcfg, config), load.seed, on_host=sharded)
    return serving_model(model, load.quantization, load.cpu_matmul, tp), tokenizer


def model_shapes(model, config: EngineConfig) -> "tuple[ModelConfig, Tokenizer | None]":
    """The simulator's model: its config (and tokenizer, for a checkpoint), no weights."""
    if isinstance(model, Llama):
        raise ValueError("runner='sim' takes a model name or a ModelConfig, not a built Llama")
    checkpoint = resolve_checkpoint(model)
    mcfg = model if isinstance(model, ModelConfig) else model_config_of(model)
    return with_dtypes(mcfg, config), (None if checkpoint is None else Tokenizer.from_dir(checkpoint[0]))


def with_dtypes(mcfg: ModelConfig, config: EngineConfig) -> ModelConfig:
    """The model config with the dtype options that are set."""
    load = config.load
    return mcfg.replace(**{k: v for k, v in (("dtype", load.dtype), ("matmul_dtype", load.matmul_dtype)) if v})


def resolve_sizes(config: EngineConfig, mcfg: ModelConfig, kv_pages_of=None) -> EngineConfig:
    """The config with the sizes that depend on the model and the machine set: max_model_len (the model's limit when
    None), num_pages (what kv_cache_memory_gib holds; for a simulated accelerator, what its memory holds after the
    weights: `kv_pages_of(page_size)`), num_host_pages (0 unless preemption is by swap), num_host_cache_pages
    (the prefix cache's host tier: 0 unless prefix caching is on). A pool larger than the
    memory that would hold it is refused here, before anything is allocated."""
    sched, cache, sim = config.scheduler, config.cache, config.sim.enabled
    max_model_len = sched.max_model_len or mcfg.max_position_embeddings
    if max_model_len > mcfg.max_position_embeddings:
        raise ValueError(
            f"max_model_len={max_model_len} exceeds the model's max_position_embeddings "
            f"({mcfg.max_position_embeddings}); choose max_model_len <= {mcfg.max_position_embeddings}"
        )
    page_bytes = kv_cache_bytes_per_page(mcfg, cache.page_size, cache.kv_cache_dtype)
    num_pages = cache.num_pages
    if num_pages is None and sim and kv_pages_of is not None:
        num_pages = kv_pages_of(cache.page_size)
        if num_pages < 1:
            raise ValueError("the simulated accelerator's memory holds no KV page after the weights")
    if num_pages is None:
        spec = config.speculative
        drafter = None if spec is None else spec.draft_model
        budget = page_bytes
        if drafter is not None:  # the draft's KV pages mirror the target's (runner/speculation/draft_runner.py)
            budget += kv_cache_bytes_per_page(draft_config(drafter), cache.page_size, cache.kv_cache_dtype)
        num_pages = int(cache.kv_cache_memory_gib * 2**30) // budget
        if num_pages < 1:
            raise ValueError(
                f"kv_cache_memory_gib={cache.kv_cache_memory_gib} holds no KV page (one page of {cache.page_size} "
                f"tokens takes {budget} bytes for this model); raise it or set num_pages"
            )
    num_host_pages = 0
    if sched.preemption_mode == "swap":
        num_host_pages = cache.num_host_pages
        if num_host_pages is None:
            num_host_pages = int(cache.swap_space_gib * 2**30) // page_bytes
    num_host_cache_pages = 0  # the prefix cache's host tier (core/host_prefix_cache.py)
    if cache.enable_prefix_caching:
        num_host_cache_pages = cache.num_host_cache_pages
        if num_host_cache_pages is None:
            num_host_cache_pages = int(cache.host_cache_gib * 2**30) // page_bytes
    if not sim:  # (a simulated accelerator's pool is not this machine's memory)
        G = cache.page_size
        check_fits("KV cache (num_pages / kv_cache_memory_gib)", num_pages, G, page_bytes, device_memory_bytes())
        check_fits(
            "host swap pool (num_host_pages / swap_space_gib)", num_host_pages, G, page_bytes, host_memory_bytes()
        )
        check_fits(
            "host prefix cache (num_host_cache_pages / host_cache_gib)",
            num_host_cache_pages,
            G,
            page_bytes,
            host_memory_bytes(),
        )
    return dataclasses.replace(
        config,
        scheduler=sched.replace(max_model_len=max_model_len),
        cache=cache.replace(
            num_pages=num_pages, num_host_pages=num_host_pages, num_host_cache_pages=num_host_cache_pages
        ),
    )


def sim_runner(config: EngineConfig, mcfg: ModelConfig, cost_model, clock, buckets: BucketTable) -> SimRunner:
    return SimRunner(
        cost_model,
        clock,
        buckets=buckets,
        kv_bytes_per_page=kv_cache_bytes_per_page(mcfg, config.cache.page_size, config.cache.kv_cache_dtype),
        vocab_size=mcfg.vocab_size,
        eos_token_id=mcfg.eos_token_id,
        stop_token_ids=mcfg.extra_eos_token_ids,
    )
