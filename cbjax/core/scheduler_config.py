"""SchedulerConfig: the scheduling sub-config of EngineConfig: the policy, the step's slot and token limits, chunked
prefill, admission headroom, preemption, and how steps are dispatched (asynchronously, in blocks)."""

import dataclasses

from cbjax.config import validation as check
from cbjax.config.section import Section
from cbjax.core.policy_zoo import POLICIES, make_policy

PREEMPTION_MODES = ("recompute", "swap")


@dataclasses.dataclass(frozen=True)
class SchedulerConfig(Section):
    policy: str = "fcfs"  # scheduling policy: a name in cbjax.core.policy_zoo.POLICIES (docs/policies.md)
    policy_options: dict | None = None  # the policy's constructor options, e.g. {"aging_s": 5.0}
    max_num_seqs: int = 64  # slots per step
    max_num_batched_tokens: int = 512  # token budget per step (prefill chunks + decodes)
    max_model_len: int | None = None  # prompt + output tokens; None: the model's max_position_embeddings
    enable_chunked_prefill: bool = True  # policies that do not say otherwise may split prompts over steps
    watermark_fraction: float = 0.01  # fraction of the pages kept free at admission, so running sequences can grow
    static_batch_timeout_s: float = 0.0  # static: wait for a full batch or this long (0: start with what waits)
    preemption_mode: str = "recompute"  # recompute: drop a victim's KV | swap: move it to host memory and back
    # Schedule and start step n+1 before the results of step n reach the host (its sampled tokens are fed to step
    # n+1 on the device), so host work overlaps the device's. False: one step at a time.
    async_scheduling: bool = True
    # Up to this many decode steps per dispatch, where that changes no scheduling decision (nothing waits, every
    # running sequence decodes): the host's work is paid once per block (cbjax/core/multi_step.py, vLLM's option of
    # the same name). Tokens then reach the host, and stream, a block at a time; 1: one step per dispatch.
    num_scheduler_steps: int = 1

    def checked(self) -> dict:
        values = dict(
            policy=check.choice("policy", self.policy, sorted(POLICIES)),
            policy_options=check.mapping("policy_options", self.policy_options) or None,
            max_num_seqs=check.integer("max_num_seqs", self.max_num_seqs, 1),
            max_num_batched_tokens=check.integer("max_num_batched_tokens", self.max_num_batched_tokens, 1),
            max_model_len=check.optional_integer("max_model_len", self.max_model_len, 1),
            enable_chunked_prefill=check.boolean("enable_chunked_prefill", self.enable_chunked_prefill),
            watermark_fraction=check.real("watermark_fraction", self.watermark_fraction, 0.0, 1.0, high_open=True),
            static_batch_timeout_s=check.real("static_batch_timeout_s", self.static_batch_timeout_s, 0.0),
            preemption_mode=check.choice("preemption_mode", self.preemption_mode, PREEMPTION_MODES),
            async_scheduling=check.boolean("async_scheduling", self.async_scheduling),
            num_scheduler_steps=check.integer("num_scheduler_steps", self.num_scheduler_steps, 1),
        )
        self.make_policy(values)  # its options' names, types and ranges (a cheap object)
        return values

    def make_policy(self, values: dict | None = None):
        """A new policy object as configured (`values`: this config's checked fields, while it is being built)."""
        v = values or dataclasses.asdict(self)
        return make_policy(v["policy"], v["policy_options"], batch_timeout_s=v["static_batch_timeout_s"])


def pages_for(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)
