"""The scheduler's part of multi-step decoding: a decode-only step whose next steps are foregone conclusions is
planned as up to `num_scheduler_steps` steps that the device runs in one dispatch (cbjax/runner/decode_loop.py).

Why: at 64 running sequences the host's work per step (schedule, pack, launch, update; ~1.4 ms on 2 cores) was
7% of a llama-tiny decode step's time even with asynchronous scheduling, because on 2 cores the host's Python
competes with the step's compute threads. N steps per dispatch pay that once (vLLM's `num_scheduler_steps` did the
same for GPUs).

When: only where N single steps would have scheduled exactly this batch N times, so no scheduling decision
changes: nothing waits (no admission, no priority preemption), every running request is in the step or has its
final token pending, each scheduled sequence is a decode (one token, sampling) without sampling extras (their
bans, biases and masks are packed on the host before each token, cbjax/runner/extras_runner.py), there is no swap,
preemption, draft or sliding-window eviction this step, and the pool has the pages for every sequence's extra
tokens now. With a speculator, a step without drafts is a block candidate too: where the draft-length rule chose
k = 0 (`batch_size` at a large batch, `measured` when drafts do not pay), and where it wanted drafts but the
proposer found none for any sequence (measured at batch 1 on held-out tinypy code, n-gram k = 4: blocks of 8 there
gave 1.95x, 1.48x, 1.49x of the default where single steps gave 1.98x, 1.29x, 1.21x; blocks of 4 in between).
The speculator keeps no per-step state that a block could skip: its tallies count verified drafts only, and the
engine receives a block (like any step in flight) before a step that wants drafts.
A sequence gets as many steps as its max_tokens and max_model_len allow, up to N (so none outlives its length limit);
the block is as long as its longest sequence's steps (at least 2), and a sequence with fewer leaves its
slot idle for the rest of the block (nothing waits that could take it).
What differs from single steps: a sequence that stops on EOS or a stop token inside a block computes (and drops)
the rest of the block's tokens, as asynchronous scheduling already does for one step (those rows, and those of
slots idle past their steps, are counted in SchedulerOutput.num_wasted_tokens); a request arriving during a block
waits for its end, unless the block streams its rows (then the engine asks it to end after its running step and
`shorten_block` gives the steps that did not run back, where `can_shorten_block` allows); and, where the runner
cannot stream a block's rows (cbjax/runner/token_stream.py: on the CPU a
streaming LLMEngine takes them one per step()), its tokens reach the host together at the end of the block
(streaming deltas of up to N tokens, inter-token latencies of 0 within them). Hence on for the offline LLM facade
(cbjax/llm.py: nothing arrives, final outputs only) and off by default in LLMEngine (num_scheduler_steps=8 there
trades the admission delay for less host work per token: docs/benchmarks.md, "Host time at 64 running
sequences").

Kept out of scheduler.py, which calls `plan_decode_steps` with itself as `sched` (not imported here).
"""

from cbjax.core.policy import scheduled_hook
from cbjax.core.request import PENDING_TOKEN, FinishReason, RequestStatus
from cbjax.core.scheduler_config import pages_for
from cbjax.core.scheduler_output import SchedulerOutput
from cbjax.core.speculation.speculative_blocks import plan_speculative_block


def plan_decode_steps(sched, out: SchedulerOutput) -> None:
    """Turn the decode-only step `out` (scheduled, its first step committed) into a block of up to N steps when
    that changes no decision (see the module docstring): each sequence's `num_steps` and `out.num_steps` are set,
    its extra tokens counted as computed, pending, and charged to the policy, and its pages allocated. Otherwise
    leaves `out` as it is (one step)."""
    if plan_speculative_block(sched, out):  # n-gram speculation in the block, on the device (if it is on)
        return
    cfg = sched.config
    N = cfg.num_scheduler_steps
    seqs = out.seqs
    if (
        N < 2
        or not seqs
        or sched.waiting
        or out.preempted
        or out.swap_out
        or out.swap_in
        or out.num_draft_tokens  # (a step with drafts also has more tokens than sequences)
        or sched.window is not None
        or out.num_batched_tokens != len(seqs)  # one token each
    ):
        return
    G, max_len, pool = sched.cache.page_size, cfg.max_model_len, sched.pool
    scheduled = set()
    steps, needs = [], []
    for s in seqs:
        req = s.request
        if not s.samples_token or req.samples_with_extras:  # (extras are applied between steps, on the host)
            return
        scheduled.add(id(req))
        # Its first step's pending token is appended: each further step adds one input and one output.
        k = 1 + min(N - 1, req.params.max_tokens - len(req.output_token_ids), max_len - len(req.all_token_ids))
        steps.append(k)
        needs.append(max(0, pages_for(req.num_computed_tokens + k - 1, G) - req.num_dropped_pages - len(req.pages)))
    if max(steps) < 2:
        return
    for req in sched.running:  # one left out of the step (its final token pending) is left out of every step
        if id(req) not in scheduled and not req.pending_is_final(max_len):
            return
    new_pages = sum(needs)
    if new_pages and not pool.can_allocate(new_pages):
        return
    policy, now = sched.policy, out.time
    hook = scheduled_hook(policy)  # (None: nothing to call, k - 1 times per sequence)
    for s, k, need in zip(seqs, steps, needs):
        req = s.request
        s.num_steps = k
        if need:
            req.pages.extend(pool.allocate(need, policy.choose_eviction))
        if hook is not None:  # what scheduling a decode does, once per further step
            for _ in range(k - 1):
                hook(req, 1, now)  # (a hook may read the request: VTC reads its computed tokens)
                req.num_computed_tokens += 1
                req.append_pending_token()
            continue
        pending = [PENDING_TOKEN] * (k - 1)  # the same for the k - 1 steps at once
        req.num_computed_tokens += k - 1
        req.output_token_ids += pending
        req.all_token_ids += pending
        req.num_pending_tokens += k - 1
    out.num_steps = max(steps)
    out.num_wasted_tokens = sum(out.num_steps - k for k in steps)  # rows of slots idle past their last step


def can_shorten_block(sched, out: SchedulerOutput) -> bool:
    """Whether block `out` may end before its planned steps (`shorten_block` can give back what the steps that did
    not run were charged): no speculator (its proposer and draft model track the requests' tokens), no sample group
    or shared page (the pages a block gives back are its own tail pages), a policy whose `on_scheduled` does
    nothing (the steps were charged to it at once; VTC or MLFQ would keep the charge)."""
    if sched.speculator is not None or scheduled_hook(sched.policy) is not None:
        return False
    return all(s.request.group is None and not s.request.shares_pages for s in out.seqs)


def shorten_block(sched, out: SchedulerOutput, steps_run: int) -> None:
    """Block `out` ended after `steps_run` of its `out.num_steps` steps (the engine asked it to, as a request arrived;
    `can_shorten_block` held): each unfinished sequence gives back the steps it did not run, as if planned with
    `steps_run` (its pending placeholders, computed tokens and the pages only those needed); the block's count of
    wasted rows is what it would have been. Call before the block's rows past `steps_run` would be received and
    before the next step is scheduled."""
    N, m = out.num_steps, steps_run
    if m >= N:
        return
    G, pool = sched.cache.page_size, sched.pool
    wasted = 0
    for s in out.seqs:
        req, k = s.request, s.num_steps
        wasted += (m - min(k, m)) - (N - k)  # (a slot idle past its steps, counted at planning)
        s.num_steps = min(k, m)
        if req.status is RequestStatus.FINISHED:  # stopped in the block (its pending outputs dropped then) or aborted
            if req.finish_reason is not FinishReason.ABORT:
                wasted -= k - min(k, m)  # (receive_step counted the rows to the planned end)
            continue
        cut = k - min(k, m)
        if cut:
            del req.output_token_ids[-cut:]
            del req.all_token_ids[-cut:]
            req.num_pending_tokens -= cut
            req.num_computed_tokens -= cut
            keep = pages_for(req.num_computed_tokens, G) - req.num_dropped_pages
            if len(req.pages) > keep:
                pool.free(req.pages[keep:])
                del req.pages[keep:]
    out.num_steps = m
    out.num_wasted_tokens += wasted
