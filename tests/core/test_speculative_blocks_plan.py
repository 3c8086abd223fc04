"""Speculative blocks on the scheduler alone (cbjax/core/speculation/speculative_blocks.py), with a fake device that
runs a block's iterations as the real one does (cbjax/runner/speculation/speculative_block.py) on the fake runner's
KV: every row's K/V is written through the sequence's page table (a write past the pages the plan gave it fails,
rejected drafts leave their K/V behind for later tokens to overwrite), every sample is read back through it. Every
policy, both preemption modes, aborts, EOS: the outputs are the reference tokens, no page leaks, no pending token
is left after a block."""

import dataclasses
import random

from hypothesis import HealthCheck, given, settings

from cbjax.core import Request, SamplingParams, VirtualClock
from cbjax.core.request import PENDING_TOKEN
from cbjax.core.speculation.config import SpeculativeConfig
from cbjax.core.speculation.speculative_blocks import budgets, is_speculative_block
from cbjax.core.speculation.speculator import Speculator
from tests.core.fake_runner import assert_reference_outputs, next_token
from tests.core.scheduler_setup import FlatConfig, make_scheduler
from tests.core.test_policy_invariants import EOS, VOCAB, Case, admit_and_abort, cases, check_step
from tests.core.test_speculation import MostlyRightProposer, execute_with_drafts

K, N = 3, 4  # drafts per iteration, iterations per block


def execute_block(kv: dict, sched, out, rng: random.Random) -> list:
    """The fake device's speculative block: per sequence (tokens, drafted per iteration, accepted per iteration).
    An iteration drafts a random number of tokens within the budget, each the right next token 7 times in 10."""
    G = sched.cache.page_size
    results = []
    for seq, budget in zip(out.seqs, budgets(out)):
        r = seq.request
        pos = r.num_tokens - 2  # the last known token's position: the block computes its K/V first
        last = r.all_token_ids[pos]
        assert PENDING_TOKEN not in r.all_token_ids[: pos + 1]

        def write(p: int, token: int, r=r) -> None:
            page = r.pages[p // G]  # (IndexError: past the pages the plan allocated)
            assert sched.pool.refcount(page) == 1, f"{r.request_id} writes position {p} into a shared page"
            kv[page, p % G] = (token, p)

        def sample_at(end: int, r=r) -> int:
            ctx = tuple(kv.get((r.pages[p // G], p % G)) for p in range(end))
            return next_token(ctx, VOCAB) if None not in ctx else -2

        tokens, drafted, accepted = [], [0] * N, [0] * N
        for i in range(N):
            if len(tokens) >= budget:
                break
            d = rng.randint(0, min(K, budget - len(tokens) - 1))
            write(pos, last)
            new, rejected = [], False
            for j in range(d + 1):
                y = sample_at(pos + j + 1)
                if rejected or j == d:
                    new += [] if rejected else [y]
                    if j < d:
                        write(pos + j + 1, rng.randrange(3, VOCAB))  # a row past the rejection: computed anyway
                    continue
                draft = y if rng.random() < 0.7 else 3 + (y + 1 - 3) % (VOCAB - 3)
                write(pos + j + 1, draft)
                if draft == y:
                    new.append(draft)
                else:
                    new.append(y)
                    rejected = True
            drafted[i], accepted[i] = d, len(new) - 1
            tokens += new
            pos, last = pos + len(new), new[-1]
        results.append((tokens, drafted, accepted))
    return results


def run_blocks(case: Case, seed: int):
    """Run the case synchronously with speculative blocks on; returns the scheduler and its steps."""
    clock, rng = VirtualClock(), random.Random(seed)
    spec = Speculator(
        SpeculativeConfig(num_speculative_tokens=K, device_blocks=True), proposer=MostlyRightProposer(seed)
    )
    cfg = dataclasses.replace(case.config, policy_options=case.policy_options, num_scheduler_steps=N)
    s = make_scheduler(cfg, clock, speculator=spec)
    kv, reqs, expected, steps = {}, {}, {}, []
    pending = sorted(enumerate(case.requests), key=lambda x: x[1][0])
    while pending or s.has_unfinished():
        admit_and_abort(s, case, clock, len(steps), pending, reqs, expected)
        out = s.schedule()
        steps.append(out)
        block = is_speculative_block(out)
        tokens = execute_block(kv, s, out, rng) if block else execute_with_drafts(kv, s, out)
        clock.advance(0.001)
        s.update(out, tokens, EOS, clock.now())
        if block:  # its rows: K + 1 per sequence, the bucket the runner packs it in
            assert out.num_batched_tokens == len(out.seqs) * (K + 1) <= s.config.max_num_batched_tokens
            s.pool.check_consistent()
        else:
            check_step(s, out)
        for r in s.running:
            assert PENDING_TOKEN not in r.all_token_ids or not block
        assert len(steps) < 5000, "requests did not finish"
    assert_reference_outputs(reqs, expected, s, case.config.num_pages)
    return s, steps


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_every_policy_with_speculative_blocks_finishes_with_reference_tokens(case):
    run_blocks(case, seed=len(case.requests))


def test_a_lone_decode_becomes_a_block_with_its_budget_and_pages():
    """One request: after its prefill every step is a speculative block, each sequence's budget the least of N (K + 1),
    its remaining max_tokens and what max_model_len leaves; the speculator tallies the device's drafts."""
    cfg = FlatConfig(max_num_seqs=4, max_num_batched_tokens=32, page_size=4, num_pages=40, max_model_len=48)
    s, steps = run_blocks(Case(cfg, {}, [(0, list(range(3, 13)), 38, 0, "a", None, None)]), seed=3)
    blocks = [o for o in steps if is_speculative_block(o)]
    assert len(blocks) >= 2 and all(o.num_steps == N for o in blocks)
    assert budgets(blocks[0]) == [N * (K + 1)]
    assert budgets(blocks[-1])[0] < N * (K + 1)  # the last: its remaining max_tokens (10 + 38 = max_model_len)
    spec = s.speculator
    assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens


def test_no_block_while_a_request_waits_or_the_rule_drafts_fewer():
    cfg = FlatConfig(max_num_seqs=1, max_num_batched_tokens=32, page_size=4, num_pages=40, max_model_len=48)
    config = SpeculativeConfig(num_speculative_tokens=K, device_blocks=True)
    s = make_scheduler(dataclasses.replace(cfg, num_scheduler_steps=N), VirtualClock(), speculator=Speculator(config))
    for i in range(2):  # one slot: the second waits for the first to finish
        s.add(Request(f"r{i}", [3, 4, 5, 3, 4, 5], SamplingParams(max_tokens=12, ignore_eos=True), 0.0, 0, i))
    kv, seen, rng = {}, [], random.Random(0)
    while s.has_unfinished():
        out = s.schedule()
        block = is_speculative_block(out)
        seen.append((block, bool(s.waiting)))
        s.update(out, execute_block(kv, s, out, rng) if block else execute_with_drafts(kv, s, out), EOS, 0.0)
    assert not any(block and waiting for block, waiting in seen)
    assert any(block for block, _ in seen)  # (the second request, alone)
    off = Speculator(dataclasses.replace(config, device_blocks=None))  # a scheduler given None: off
    s = make_scheduler(dataclasses.replace(cfg, num_scheduler_steps=N), VirtualClock(), speculator=off)
    s.add(Request("a", [3, 4, 5, 3, 4, 5], SamplingParams(max_tokens=12, ignore_eos=True), 0.0, 0, 0))
    while s.has_unfinished():
        out = s.schedule()
        assert not is_speculative_block(out)
        s.update(out, execute_with_drafts(kv, s, out), EOS, 0.0)
