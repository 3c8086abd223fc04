"""The iteration-level scheduler: which sequences run this step, how many tokens each, and their pages.

Every step has a token budget (`max_num_batched_tokens`) and a slot cap (`max_num_seqs`). Each scheduled sequence
computes its next uncomputed tokens: a whole prompt, a prompt chunk, one decode token, or the recompute of a
preempted sequence are all the same operation. A sequence whose chunk reaches the end of its context samples one
new token. Finished sequences leave at `update`, so their slot and pages serve the very next step.
"""
import collections
import dataclasses
from collections.abc import Sequence

from cbjax.core.clock import Clock
from cbjax.core.page_pool import PagePool
from cbjax.core.policies import Policy, make_policy
from cbjax.core.request import FinishReason, Request, RequestStatus


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64  # slots per step
    max_num_batched_tokens: int = 512  # tokens per step, prefill chunks and decodes together
    page_size: int = 16  # tokens per KV page
    num_pages: int = 1024  # pages in the pool
    max_model_len: int = 2048  # prompt + output tokens of one sequence
    policy: str = "fcfs"
    enable_chunked_prefill: bool = True
    # Pages kept free at admission so running sequences can grow without an immediate preemption.
    watermark_pages: int = 0
    # static: a new batch waits until full or until its oldest request waited this long (0: start at once).
    static_batch_timeout_s: float = 0.0

    def __post_init__(self):
        for name in ("max_num_seqs", "max_num_batched_tokens", "page_size", "num_pages", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclasses.dataclass
class ScheduledSeq:
    request: Request
    num_computed: int  # tokens already in the cache before this step
    num_new_tokens: int  # tokens computed this step
    sample: bool  # the chunk reaches the end of the context: sample one new token


@dataclasses.dataclass
class SchedulerOutput:
    seqs: list[ScheduledSeq]
    num_batched_tokens: int
    preempted: list[Request]
    time: float

    @property
    def is_empty(self) -> bool:
        return not self.seqs


def pages_for(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


class Scheduler:
    def __init__(self, config: SchedulerConfig, clock: Clock, policy: Policy | None = None):
        self.config = config
        self.clock = clock
        self.policy = policy or make_policy(config.policy, max_num_seqs=config.max_num_seqs,
                                            batch_timeout_s=config.static_batch_timeout_s)
        self.pool = PagePool(config.num_pages)
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []  # in admission order
        self.num_preemptions = 0

    # ---- queue management -------------------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def abort(self, request: Request) -> None:
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._finish(request, FinishReason.ABORT)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def can_ever_fit(self, num_tokens: int) -> bool:
        return num_tokens <= self.config.max_model_len and pages_for(num_tokens, self.config.page_size) <= self.config.num_pages

    # ---- one step ---------------------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        preempted: list[Request] = []
        now = self.clock.now()

        if self.policy.admits_whole_batch and self.policy.may_admit(self.running, self.waiting, now):
            while self.waiting and len(self.running) < cfg.max_num_seqs:
                req = self.waiting.popleft()
                req.status = RequestStatus.RUNNING
                self.running.append(req)

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = self._num_new_tokens(req, budget)
            if n == 0:
                i += 1
                continue
            need = pages_for(req.num_computed_tokens + n, cfg.page_size) - len(req.pages)
            while not self.pool.can_allocate(need):
                victim = self.policy.choose_victim(self.running[i:])
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                continue  # it preempted itself; the list shifted under index i
            req.pages.extend(self.pool.allocate(need))
            scheduled.append(self._scheduled(req, n, now))
            budget -= n
            i += 1

        if (not preempted and not self.policy.admits_whole_batch
                and self.policy.may_admit(self.running, self.waiting, now)):
            while self.waiting and budget > 0 and len(self.running) < cfg.max_num_seqs:
                idx = self.policy.next_waiting_index(self.waiting)
                req = self.waiting[idx]
                n = self._num_new_tokens(req, budget)
                if n == 0:
                    break
                need = pages_for(req.num_computed_tokens + n, cfg.page_size)
                watermark = cfg.watermark_pages if self.running else 0
                if not self.pool.can_allocate(need + watermark):
                    break
                del self.waiting[idx]
                req.status = RequestStatus.RUNNING
                req.pages = self.pool.allocate(need)
                self.running.append(req)
                scheduled.append(self._scheduled(req, n, now))
                budget -= n

        return SchedulerOutput(scheduled, cfg.max_num_batched_tokens - budget, preempted, now)

    def _num_new_tokens(self, req: Request, budget: int) -> int:
        n = min(req.num_uncomputed_tokens, budget)
        if n < req.num_uncomputed_tokens and not self.config.enable_chunked_prefill:
            return 0
        return n

    def _scheduled(self, req: Request, n: int, now: float) -> ScheduledSeq:
        if req.metrics.first_scheduled_time is None:
            req.metrics.first_scheduled_time = now
        return ScheduledSeq(req, req.num_computed_tokens, n, req.num_computed_tokens + n == req.num_tokens)

    def _preempt(self, req: Request) -> None:
        """Preempt by recompute: drop the KV, keep the generated tokens, requeue first in line."""
        self.running.remove(req)
        self.pool.free(req.pages)
        req.pages = []
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        req.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    # ---- after the step ---------------------------------------------------------------------------------------
    def update(self, out: SchedulerOutput, sampled: Sequence[int], eos_token_id: int | None,
               now: float) -> list[Request]:
        """Advance the scheduled sequences by the step's results; return those with a new token or finished."""
        changed = []
        for seq, token in zip(out.seqs, sampled):
            req = seq.request
            if req.status is not RequestStatus.RUNNING:
                continue  # aborted while the step ran
            req.num_computed_tokens += seq.num_new_tokens
            if not seq.sample:
                continue
            token = int(token)
            req.append_token(token)
            m = req.metrics
            if m.first_token_time is None:
                m.first_token_time = now
            m.token_times.append(now)
            reason = self._stop_reason(req, token, eos_token_id)
            if reason is not None:
                self.running.remove(req)
                self._finish(req, reason, now)
            changed.append(req)
        return changed

    def _stop_reason(self, req: Request, token: int, eos_token_id: int | None) -> FinishReason | None:
        p = req.params
        if token in p.stop_token_ids or (not p.ignore_eos and eos_token_id is not None and token == eos_token_id):
            return FinishReason.STOP
        if len(req.output_token_ids) >= p.max_tokens or req.num_tokens >= self.config.max_model_len:
            return FinishReason.LENGTH
        return None

    def _finish(self, req: Request, reason: FinishReason, now: float | None = None) -> None:
        self.pool.free(req.pages)
        req.pages = []
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.metrics.finished_time = self.clock.now() if now is None else now
