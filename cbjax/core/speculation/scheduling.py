"""The scheduler's part of speculative decoding: the drafts a decode gets this step, and advancing a sequence by
what the device accepted (rolling back the rest). Kept out of scheduler.py, which calls these two functions with
itself as `sched` (not imported here: scheduler.py imports this module), through its public methods.

Invariants: a sequence's `num_computed_tokens` never counts an unverified draft (so preemption, swap, the prefix
cache and sliding-window eviction only ever see verified KV); draft positions get pages like any token (trimmed to
the pages free now: drafts never preempt anyone); a speculating step is received before the next one is scheduled.
"""

from collections.abc import Sequence

from cbjax.core.request import Request, RequestStatus
from cbjax.core.scheduler_output import ScheduledSeq


def drafts(sched, req: Request, computed: int, n: int, budget: int, have: int) -> list[int]:
    """Draft tokens for `req` if it is a decode (it computes exactly its last token, whose value the host knows),
    trimmed to the budget left after its own token, its remaining outputs, max_model_len, the policy's chunk size
    and the pages free now (`have`: the logical pages it holds). Never fewer tokens for the sequence itself."""
    decode = n == 1 and computed + 1 == req.num_tokens
    if not decode or req.status is not RequestStatus.RUNNING or req.num_pending_tokens:
        return []
    cfg = sched.config
    limit = min(
        budget - n,
        req.params.max_tokens - len(req.output_token_ids) - 1,  # the step's outputs stay within max_tokens
        cfg.max_model_len - req.num_tokens - 1,
        sched.cache.page_size * (have + sched.pool.num_free) - req.num_tokens,
    )
    if sched.policy.chunk_size is not None:
        limit = min(limit, sched.policy.chunk_size - n)
    return sched.speculator.drafts(req, limit) if limit > 0 else []


def receive_verified(
    sched, req: Request, seq: ScheduledSeq, tokens: Sequence[int], eos_token_id: int | None, now: float
) -> int:
    """A speculating sequence's step result: its accepted drafts, then one sampled token (the correction of the
    first rejected draft, or the bonus token after all of them). Each accepted draft's KV was computed in the step,
    so the computed tokens advance with it; the rejected drafts' positions stay uncomputed (their KV slots are
    overwritten later, never read). Returns how many tokens the request kept (`receive_tokens`). (The engine
    receives a speculating step before it schedules the next, so the request is still running here with no other
    pending token.)"""
    sched.speculator.record(len(seq.draft_token_ids), len(tokens) - 1)
    kept = receive_tokens(sched, req, tokens, eos_token_id, now)
    if sched.pool.enable_caching and req.status is RequestStatus.RUNNING:
        sched.register_full_pages(req)
    return kept


def receive_tokens(sched, req: Request, tokens: Sequence[int], eos_token_id: int | None, now: float) -> int:
    """Verified tokens of a running request, in order: the first is its pending output's value, each later one is
    appended with the token before it counted as computed (an accepted draft, whose KV the device wrote). Stop
    conditions apply in order: a stop finishes the request and drops the tokens after it. Returns how many tokens
    the request kept (a verify step's, or a speculative block's, core/speculation/speculative_blocks.py)."""
    m = req.metrics
    if m.first_token_time is None:
        m.first_token_time = now
    i, max_len = -1, sched.config.max_model_len
    for j, token in enumerate(tokens):
        if j == 0:
            i = req.receive_token(int(token))
        else:
            req.append_token(int(token))
            req.num_computed_tokens += 1
            i += 1
        m.token_times.append(now)
        reason = req.stop_reason(i, eos_token_id, max_len)
        if reason is not None:
            req.drop_outputs_after(i)
            sched.unqueue(req)
            sched.finish(req, reason, now)
            return j + 1
    return len(tokens)
