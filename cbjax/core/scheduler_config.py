"""The scheduler's sizes and switches (the engine fills them from EngineConfig and the model)."""

import dataclasses


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64  # slots per step
    max_num_batched_tokens: int = 512  # tokens per step, prefill chunks and decodes together
    page_size: int = 16  # tokens per KV page
    num_pages: int = 1024  # pages in the pool
    max_model_len: int = 2048  # prompt + output tokens of one sequence
    policy: str = "fcfs"  # a name in cbjax.core.policies.POLICIES
    policy_options: dict = dataclasses.field(default_factory=dict)  # the policy's constructor options
    enable_chunked_prefill: bool = True  # policies that do not say otherwise may split prompts over steps
    # Pages kept free at admission so running sequences can grow without an immediate preemption.
    watermark_pages: int = 0
    # static: a new batch waits until full or until its oldest request waited this long (0: start at once).
    static_batch_timeout_s: float = 0.0
    preemption_mode: str = "recompute"  # recompute: drop the KV | swap: move it to host pages, bring it back
    num_host_pages: int = 0  # swap: host pool size in pages; a victim that does not fit is recomputed
    enable_prefix_caching: bool = False  # reuse full KV pages of identical prefixes (chained page hashes)
    # The model attends to the last `sliding_window` positions only: with evict_outside_window, a sequence's pages
    # that lie wholly before every position its next queries can read are freed (at most
    # pages_for(sliding_window + new tokens - 1) + 1 pages held while it computes a chunk).
    sliding_window: int | None = None
    evict_outside_window: bool = True
    # Up to this many decode steps per dispatch where that changes no scheduling decision (core/multi_step.py).
    num_scheduler_steps: int = 1

    def __post_init__(self):
        sizes = ("max_num_seqs", "max_num_batched_tokens", "page_size", "num_pages", "max_model_len")
        for name in (*sizes, "num_scheduler_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}")
        if self.num_host_pages < 0:
            raise ValueError(f"num_host_pages must be >= 0, got {self.num_host_pages}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {self.sliding_window}")


def pages_for(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)
