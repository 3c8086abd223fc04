"""Receiving a step's results in the scheduler (Scheduler.update): each sampled token replaces its pending
placeholder, newly full pages go to the prefix cache, stopped requests finish.

Kept out of scheduler.py, which calls this with itself as `sched` (not imported here, like preemption.py); it reads
the scheduler's public state and methods (pool, cache, config, register_full_pages, unqueue, finish).
"""

from collections.abc import Sequence

from cbjax.core.request import RequestStatus
from cbjax.core.scheduler_output import SchedulerOutput
from cbjax.core.speculation import scheduling as speculation

_FINISHED, _RUNNING = RequestStatus.FINISHED, RequestStatus.RUNNING


def receive_step(
    sched, out: SchedulerOutput, sampled: Sequence[int], eos_token_id: int | None, now: float, first_step: int = 0
) -> list:
    """The results of step `out` reached the host: each sampled token replaces its pending placeholder, newly
    full pages go to the prefix cache, stopped requests finish. Returns the requests that got a token. A block
    of steps (multi_step.py) gives a row of tokens per step (`sampled` [num_steps, seqs]), received in order, all at
    once or in parts (a streaming block's rows, runner/token_stream.py: `sampled` holds the rows from `first_step` on).

    With asynchronous scheduling the next step is already scheduled (and running) when this is called, so a
    request may have been preempted since (it still receives its token) or have a newer pending token (dropped
    if this one stops it)."""
    changed = []
    caching, G, max_len = sched.pool.enable_caching, sched.cache.page_size, sched.config.max_model_len
    sampled = sampled.tolist() if hasattr(sampled, "tolist") else sampled  # numpy: ints in one call, not one each
    add = changed.append
    single = out.num_steps <= 1  # (then every sequence runs the one step: num_steps 1)
    for step, row in ((0, sampled),) if single else enumerate(sampled, first_step):
        for seq, token in zip(out.seqs, row):
            req = seq.request
            if req.status is _FINISHED or (not single and step >= seq.num_steps):
                continue  # aborted, or stopped while this step ran; or done with the block's steps
            if seq.draft_token_ids:
                changed += [req] * speculation.receive_verified(sched, req, seq, token, eos_token_id, now)
                continue
            if not seq.samples_token:  # a prompt chunk short of the end: its full pages only
                if caching and req.num_computed_tokens // G > req.num_registered_pages and req.status is _RUNNING:
                    sched.register_full_pages(req)
                continue
            # Request.receive_token, inline (once per generated token): the oldest pending output gets its value.
            token, outs = int(token), req.output_token_ids
            i = len(outs) - req.num_pending_tokens
            end = req.num_prompt_tokens + i + 1  # its context's length with it
            outs[i] = token
            req.all_token_ids[end - 1] = token
            req.num_pending_tokens -= 1
            m = req.metrics
            if m.first_token_time is None:
                m.first_token_time = now
            m.token_times.append(now)
            add(req)
            # (a page fills once every page_size tokens: that test first)
            if caching and req.num_computed_tokens // G > req.num_registered_pages and req.status is _RUNNING:
                sched.register_full_pages(req)
            p = req.params
            # Only a token that could stop the request asks Request.stop_reason (which decides): an EOS or stop id,
            # or the last one max_tokens or max_model_len allows.
            if not (token == eos_token_id or token in p.stop_token_ids or i + 1 >= p.max_tokens or end >= max_len):
                continue
            reason = req.stop_reason(i, eos_token_id, max_len)
            if reason is not None:
                out.num_wasted_tokens += seq.num_steps - 1 - step  # a block's steps past it (multi_step.py)
                req.drop_outputs_after(i)
                sched.unqueue(req)
                sched.finish(req, reason, now)
    return changed
