"""EngineConfig: every engine option, as typed sub-configs, each checked once where it is defined.

| sub-config | class | defined in | read by |
|---|---|---|---|
| `scheduler` | SchedulerConfig | cbjax/core/scheduler_config.py | the Scheduler, its policy, the engine's step |
| `cache` | CacheConfig | cbjax/config/cache.py | the page pools, the runners, memory sizing |
| `load` | LoadConfig | cbjax/config/model.py | model loading (cbjax/engine_build.py) |
| `parallel` | ParallelConfig | cbjax/config/parallel.py | model loading, the model runner's mesh |
| `compilation` | CompilationConfig | cbjax/config/compilation.py | the model runner's programs and caches |
| `sim` | SimConfig | cbjax/sim/config.py | which runner; the simulator's cost model |
| `speculative` | SpeculativeConfig or None | cbjax/core/speculation/config.py | the speculator, the model runner |

Users pass options flat, by name (`LLM(max_num_seqs=32, page_size=16)`, `--config.engine.page_size=16`, the
server's flags): every option name belongs to exactly one sub-config, and `from_options` routes it there; `options()`
is the flat view back (manifests, flags). The offline `LLM` facade starts from the same object with
OFFLINE_OVERRIDES applied. Values that depend on the model or the machine (num_pages, num_host_pages,
max_model_len when None) are resolved once when the engine is built (`EngineConfig.replace` with the resolved
values, cbjax/engine_build.py); the scheduler and runners read the resolved config.

Kept free of jax so the experiment harness can check a whole run's engine options before it writes a file or
compiles anything.
"""

import dataclasses
from collections.abc import Mapping

from cbjax.config.cache import CacheConfig
from cbjax.config.compilation import CompilationConfig
from cbjax.config.model import LoadConfig
from cbjax.config.parallel import ParallelConfig
from cbjax.config.section import Section
from cbjax.core.scheduler_config import SchedulerConfig
from cbjax.core.speculation.config import SpeculativeConfig
from cbjax.sim.config import SimConfig

# The flat option that holds the whole speculative sub-config (vLLM's name for it).
SPECULATIVE_OPTION = "speculative_config"

# The offline facade's changes to the defaults (cbjax/llm.py): blocks of up to 8 decode steps per dispatch where
# nothing waits and every running sequence decodes (cbjax/core/multi_step.py). Offline, nothing arrives during
# `generate` and it returns final outputs only, so a block changes no scheduling decision and no token; what it
# changes is paid once per block instead of once per step: the host's work, which on a 2-core CPU takes its time from
# the step's compute threads (docs/benchmarks.md, "Host time at 64 running sequences"). Its costs: the tokens of a
# block share one timestamp (RequestMetrics.token_times), and a slot whose sequence stopped (on EOS or a stop token)
# or has no more steps is computed till the block's end (counted: block_wasted_tokens).
OFFLINE_OVERRIDES = {"num_scheduler_steps": 8}


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    scheduler: SchedulerConfig = dataclasses.field(default_factory=SchedulerConfig)
    cache: CacheConfig = dataclasses.field(default_factory=CacheConfig)
    load: LoadConfig = dataclasses.field(default_factory=LoadConfig)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    compilation: CompilationConfig = dataclasses.field(default_factory=CompilationConfig)
    sim: SimConfig = dataclasses.field(default_factory=SimConfig)
    # Speculative decoding (docs/speculative.md): None (off), a SpeculativeConfig, or (the flat option
    # speculative_config) a dict such as {"method": "ngram", "num_speculative_tokens": 4}.
    speculative: SpeculativeConfig | None = None

    def __post_init__(self):
        """Each sub-config checked its own options when it was built; here what needs two of them."""
        for name, cls in self.sections().items():
            if not isinstance(getattr(self, name), cls):
                raise ValueError(f"EngineConfig.{name} must be a {cls.__name__}, got {type(getattr(self, name))}")
        spec = SpeculativeConfig.from_option(self.speculative)
        object.__setattr__(self, "speculative", None if spec is None else spec.resolved())
        spec = self.speculative
        if spec is not None and self.sim.enabled:
            raise ValueError("speculative_config is not supported by the simulator (runner='sim') yet")
        if spec is not None and spec.method == "draft" and self.parallel.tensor_parallel_size > 1:
            raise ValueError("speculative_config.method='draft' with tensor_parallel_size > 1 is not supported yet")

    @staticmethod
    def sections() -> dict[str, type[Section]]:
        """The sub-configs made of flat options, by attribute name."""
        return dict(
            scheduler=SchedulerConfig,
            cache=CacheConfig,
            load=LoadConfig,
            parallel=ParallelConfig,
            compilation=CompilationConfig,
            sim=SimConfig,
        )

    @classmethod
    def option_fields(cls) -> list[tuple[str, object, object]]:
        """Every flat option as (name, type, default), in the sub-configs' order (one flag each in the server)."""
        fields = [(f.name, f.type, f.default) for s in cls.sections().values() for f in dataclasses.fields(s)]
        return [*fields, (SPECULATIVE_OPTION, dict | None, None)]

    @classmethod
    def option_defaults(cls) -> dict:
        """Every flat option name and its default."""
        return {name: default for name, _, default in cls.option_fields()}

    @classmethod
    def from_options(cls, options: Mapping | None = None, /, **more) -> "EngineConfig":
        """The config of flat options, as a mapping and/or keywords (every option not given takes its default).
        ValueError for a name that is not an option, or for a value its sub-config refuses."""
        return cls().replace(**dict(options or {}), **more)

    def replace(self, **options) -> "EngineConfig":
        """A copy with some flat options changed, each routed to its sub-config (checked again)."""
        unknown = set(options) - set(self.option_defaults())
        if unknown:
            raise ValueError(f"unknown engine options: {sorted(map(str, unknown))}")
        changes = {}
        for name, section in self.sections().items():
            mine = {k: v for k, v in options.items() if k in section.option_names()}
            if mine:
                changes[name] = getattr(self, name).replace(**mine)
        if SPECULATIVE_OPTION in options:
            changes["speculative"] = options[SPECULATIVE_OPTION]
        return dataclasses.replace(self, **changes)

    def options(self) -> dict:
        """The flat view: every option by name (the speculative sub-config as a dict, or None)."""
        flat = {}
        for name in self.sections():
            section = getattr(self, name)
            flat |= {f.name: getattr(section, f.name) for f in dataclasses.fields(section)}
        spec = self.speculative
        return flat | {SPECULATIVE_OPTION: None if spec is None else spec.to_dict()}
