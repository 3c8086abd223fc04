"""A Scheduler from one flat set of options, for the scheduler's own tests.

An engine resolves its sizes from the model and the machine (cbjax/engine_build.py); a scheduler test sets them
directly. `FlatConfig` holds the options a scheduler reads (its SchedulerConfig's and CacheConfig's, resolved) plus
the model's sliding window, with the small-test defaults these tests were written against (no admission
watermark, 1024 pages, max_model_len 2048), and `make_scheduler` builds the Scheduler from it.
"""

import dataclasses

from cbjax.config.cache import CacheConfig
from cbjax.core.scheduler import Scheduler, SchedulerConfig


@dataclasses.dataclass(frozen=True)
class FlatConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    page_size: int = 16
    num_pages: int = 1024
    max_model_len: int = 2048
    policy: str = "fcfs"
    policy_options: dict = dataclasses.field(default_factory=dict)
    enable_chunked_prefill: bool = True
    watermark_pages: int = 0  # pages kept free at admission (the engine's option is a fraction of the pool)
    static_batch_timeout_s: float = 0.0
    preemption_mode: str = "recompute"
    num_host_pages: int = 0
    enable_prefix_caching: bool = False
    sliding_window: int | None = None
    evict_outside_window: bool = True
    num_scheduler_steps: int = 1

    def split(self) -> tuple[SchedulerConfig, CacheConfig]:
        options = dataclasses.asdict(self)
        # The fraction whose share of num_pages rounds down to exactly watermark_pages.
        options["watermark_fraction"] = (self.watermark_pages + 0.5) / self.num_pages
        pick = lambda cls: cls(**{k: options[k] for k in cls.option_names() if k in options})
        return pick(SchedulerConfig), pick(CacheConfig)


def make_scheduler(config: FlatConfig, clock, policy=None, speculator=None) -> Scheduler:
    sched, cache = config.split()
    return Scheduler(sched, cache, clock, sliding_window=config.sliding_window, policy=policy, speculator=speculator)
