"""The scheduler's part of speculative blocks: n-gram speculation run by the device for up to N iterations in one
dispatch (cbjax/runner/speculation/speculative_block.py says what the device does), switched on by
speculative_config.device_blocks.

When: where a block of decode steps would be planned (cbjax/core/multi_step.py: nothing waits, every running
request is in the step, each sequence a decode without sampling extras, no swap, preemption or sliding window),
with n-gram drafts wanted at the full k this step (the draft-length rule's k equals num_speculative_tokens: the
device drafts k per iteration), whether or not the host found drafts for this first iteration (the device proposes
its own, from the same rule). Then the host's drafts are dropped (the device proposes the same ones) and each
sequence gets the pages for the most tokens the block may give it: min(N (k + 1), its remaining max_tokens, what
max_model_len leaves), its budget. The step's `num_batched_tokens` is the most rows one iteration verifies,
(k + 1) per sequence (at most max_num_batched_tokens): the runner packs the block in that token bucket, whose rows
each iteration's forward pass uses (one block program per bucket). A sequence's `num_steps` is minus its budget
(never 0: its pending output fits), which the runner packs for the device: how many tokens it gets is known only
when the block is received, so the engine receives a speculative block before it schedules the next step.

Received: each sequence's tokens as a verified step's (speculation/scheduling.py): the first replaces its pending
output, each further one is appended with the K/V of the one before counted as computed; a stop (EOS, stop token,
max_tokens, max_model_len) drops the rest. The pages past what its context now needs go back to the pool.

Kept out of scheduler.py, which calls `plan_speculative_block` (through multi_step.py) and
`receive_speculative_block` with itself as `sched`.
"""

from collections.abc import Sequence

from cbjax.core.request import RequestStatus
from cbjax.core.scheduler_config import pages_for
from cbjax.core.scheduler_output import SchedulerOutput
from cbjax.core.speculation.scheduling import receive_tokens

_FINISHED, _RUNNING = RequestStatus.FINISHED, RequestStatus.RUNNING


def is_speculative_block(out: SchedulerOutput) -> bool:
    return out.num_steps > 1 and bool(out.seqs) and out.seqs[0].num_steps < 0


def budgets(out: SchedulerOutput) -> list[int]:
    """The most tokens each sequence of the speculative block `out` may get (block_budget, set when planned)."""
    return [-s.num_steps for s in out.seqs]


def receives_at_once(out: SchedulerOutput) -> bool:
    """Whether the engine must receive step `out` before it schedules the next: a step that verifies drafts, or a
    speculative block (how far its sequences advance is known only then)."""
    return bool(out.num_draft_tokens) or is_speculative_block(out)


def block_budget(req, iterations: int, k: int, max_model_len: int) -> int:
    """The most tokens a block may give `req` (its step's pending output counted among them): N (k + 1), its
    remaining max_tokens, and the tokens max_model_len leaves."""
    known = len(req.output_token_ids) - 1  # (the step's sample is pending)
    context = req.num_tokens - 1
    return min(iterations * (k + 1), req.params.max_tokens - known, max_model_len - context)


def plan_speculative_block(sched, out: SchedulerOutput) -> bool:
    """Turn the decode step `out` (scheduled with the host's drafts, if any) into a speculative block when the module
    docstring's conditions hold and the pool has the pages; returns whether it did (else `out` is unchanged)."""
    spec, cfg = sched.speculator, sched.config
    N = cfg.num_scheduler_steps
    seqs = out.seqs
    if (
        spec is None
        or not spec.config.device_blocks
        or spec.step_drafts != spec.max_drafts
        or N < 2
        or not seqs
        or sched.waiting
        or out.preempted
        or out.swap_out
        or out.swap_in
        or out.page_copies
        or sched.window is not None
        or len(seqs) * (spec.max_drafts + 1) > cfg.max_num_batched_tokens  # (the rows an iteration may verify)
    ):
        return False
    G, max_len, pool, K = sched.cache.page_size, cfg.max_model_len, sched.pool, spec.max_drafts
    scheduled, needs, budgets = set(), [], []
    for s in seqs:
        req = s.request
        decode = s.num_new_tokens == 1 + len(s.draft_token_ids) and req.num_pending_tokens == 1
        if not (decode and s.samples_token) or req.samples_with_extras or req.group is not None:
            return False
        scheduled.add(id(req))
        budget = block_budget(req, N, K, max_len)
        budgets.append(budget)
        # K/V is written up to the context's last token plus budget - 1 more (drafts never outrun the budget).
        needs.append(max(0, pages_for(req.num_tokens - 1 + budget - 1, G) - req.num_dropped_pages - len(req.pages)))
    for req in sched.running:
        if id(req) not in scheduled and not req.pending_is_final(max_len):
            return False
    new_pages = sum(needs)
    if new_pages and not pool.can_allocate(new_pages):
        return False
    policy = sched.policy
    for s, need, budget in zip(seqs, needs, budgets):
        if need:
            s.request.pages.extend(pool.allocate(need, policy.choose_eviction))
        s.num_new_tokens, s.draft_token_ids, s.num_steps = 1, (), -budget
    out.num_batched_tokens = len(seqs) * (K + 1)  # the most rows an iteration verifies: the block's token bucket
    out.num_steps = N
    return True


def receive_speculative_block(sched, out: SchedulerOutput, results: Sequence, eos_token_id, now: float) -> list:
    """`results[i]`: (tokens, drafted per iteration, accepted per iteration) of out.seqs[i]. Returns the requests
    that got a token, once per token (as Scheduler.update)."""
    changed = []
    spec, G = sched.speculator, sched.cache.page_size
    for seq, (tokens, drafted, accepted) in zip(out.seqs, results):
        req = seq.request
        for d, a in zip(drafted, accepted):
            if d:
                spec.record(d, a)
        if req.status is _FINISHED or not tokens:
            continue  # aborted while the block ran
        kept = receive_tokens(sched, req, tokens, eos_token_id, now)  # (each token's K/V computed in the block)
        changed += [req] * kept
        if req.status is _FINISHED:  # stopped: the block's tokens after the stop were computed for nothing
            out.num_wasted_tokens += len(tokens) - kept
            continue
        keep = pages_for(req.num_tokens, G) - req.num_dropped_pages  # the next decode writes its last token's K/V
        if len(req.pages) > keep:
            sched.pool.free(req.pages[keep:])
            del req.pages[keep:]
        if sched.pool.enable_caching and req.status is _RUNNING:
            sched.register_full_pages(req)
    return changed
