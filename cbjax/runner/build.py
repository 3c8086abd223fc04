"""Building a ModelRunner from the engine's configs, in the order it happens: where its arrays live (a device or a
mesh), the draft model's half (speculative decoding with a draft model), the target's parameters, its KV cache,
the host pool that swapped-out pages go to, the verification rule, the program store on disk. ModelRunner's
constructor then only assembles the parts; each builder can be called alone (tests, tools).

The engine resolves the sizes first (cbjax/engine_build.py: num_pages, num_host_pages) and runs the runner's warmup
itself afterwards.
"""

from cbjax.config.cache import CacheConfig
from cbjax.config.compilation import CompilationConfig
from cbjax.config.parallel import ParallelConfig
from cbjax.core.speculation.config import SpeculativeConfig
from cbjax.model.llama import Llama
from cbjax.runner.compilation.counter import CompileCounter
from cbjax.runner.compilation.program_store import ProgramStore
from cbjax.runner.extras_runner import SamplingExtras
from cbjax.runner.kv_cache import allocate_kv_cache
from cbjax.runner.kv_swap import build_host_pool
from cbjax.runner.model_runner import ModelRunner
from cbjax.runner.placement import Placement, place_params
from cbjax.runner.sharding import make_mesh
from cbjax.runner.speculation.acceptance import RejectionSampling, SampleAndMatch, make_rule
from cbjax.runner.speculation.draft_model import load_draft_model
from cbjax.runner.speculation.draft_runner import build_draft_runner
from cbjax.runner.speculation.verification import Speculation
from cbjax.runner.step_input import BucketTable
from kernels_pallas.dispatch import resolve_backend
from kernels_pallas.xla_attention import resolve_cpu_impls


def build_model_runner(
    model: Llama,
    *,
    cache: CacheConfig,
    compilation: CompilationConfig,
    parallel: ParallelConfig,
    speculative: SpeculativeConfig | None,
    num_scheduler_steps: int,
    buckets: BucketTable,
    device=None,
    program_store_dir: str | None = None,
    dtype: str | None = None,
    matmul_dtype: str | None = None,
) -> ModelRunner:
    """The runner of `model` (built, as it will serve) for an engine's configs.

    `cache` with its sizes resolved (num_pages, num_host_pages: 0 turns swapping off); `compilation`'s attention
    backend and interpret mode (not its warmup: the caller warms the runner up); a mesh of `parallel`'s
    tensor_parallel_size devices when > 1, else `device` (None: jax's default); `speculative` (None: off) names the
    acceptance rule and the draft model, loaded with the `dtype` and `matmul_dtype` load options (None: its own);
    `num_scheduler_steps` > 1 adds the programs of blocks of decode steps; the sampling extras follow `compilation`'s
    sampling_extras and max_logprobs; `program_store_dir`: where compiled step
    programs are kept between processes (None: nowhere)."""
    if cache.num_pages is None or cache.num_host_pages is None:
        raise ValueError("build_model_runner needs num_pages and num_host_pages resolved (engine_build.resolve_sizes)")
    tp = parallel.tensor_parallel_size
    placement = Placement(device, None if tp == 1 else make_mesh(tp))  # (ValueError for both)
    backend, interpret = resolve_backend(compilation.attention_backend), compilation.pallas_interpret
    geometry = dict(num_pages=cache.num_pages, page_size=cache.page_size, kv_cache_dtype=cache.kv_cache_dtype)
    compiles = CompileCounter()  # the target's programs and the draft's, together
    draft = None
    if speculative is not None and speculative.draft_model is not None:
        # (First: a draft the options refuse fails before the target's KV cache is allocated.)
        draft = build_draft_runner(
            load_draft_model(speculative.draft_model, dtype, matmul_dtype),
            **geometry,
            placement=placement,
            buckets=buckets,
            backend=backend,
            interpret=interpret,
            cpu_impls=resolve_cpu_impls() if backend == "xla" else None,
            compiles=compiles,
        )
    weights = place_params(model, placement)
    extras = SamplingExtras(
        model.cfg,
        buckets,
        placement,
        compiles,
        weights.graphdef,
        max_logprobs=compilation.max_logprobs,
        precompile=compilation.sampling_extras,
    )
    return ModelRunner(
        model,
        weights=weights,
        kv_caches=allocate_kv_cache(model.cfg, **geometry, placement=placement),
        placement=placement,
        buckets=buckets,
        backend=backend,
        interpret=interpret,
        compiles=compiles,
        host_pool=build_host_pool(
            model.cfg,
            cache.num_host_kv_pages,  # the swap pool's pages, then the prefix cache's host tier's
            num_device_pages=cache.num_pages,
            page_size=cache.page_size,
            kv_cache_dtype=cache.kv_cache_dtype,
        ),
        speculation=build_speculation(
            buckets,
            None if speculative is None else make_rule(speculative.acceptance),
            drafting=draft is not None,
            device_lookup=None if speculative is None else speculative.device_lookup,
        ),
        draft=draft,
        program_store=build_program_store(program_store_dir, placement),
        num_scheduler_steps=num_scheduler_steps,
        extras=extras,
    )


def build_speculation(
    buckets: BucketTable, acceptance=None, *, drafting: bool = False, device_lookup: tuple[int, int] | None = None
) -> Speculation | None:
    """What the verifying programs verify: up to buckets.max_draft_tokens drafts per sequence (None when 0: no
    speculation) by the `acceptance` rule (speculation/acceptance.py); by default rejection sampling for a draft
    model's drafts, sample-and-match for the scheduler's n-gram drafts."""
    K = buckets.max_draft_tokens
    if not K:
        return None
    if acceptance is None:
        acceptance = RejectionSampling() if drafting else SampleAndMatch()
    return Speculation(K, acceptance, device_lookup)


def build_program_store(directory: str | None, placement: Placement) -> ProgramStore | None:
    """The on-disk store of compiled step programs in `directory` (None: off). Off too for a runner on another
    device than jax's first, or on a mesh: a serialized program keeps its device assignment."""
    return ProgramStore(directory) if directory is not None and placement.on_default_device else None
