"""Blocks of decode steps (cbjax/core/multi_step.py) on the scheduler alone: when they are planned, that they give
the same tokens and the same batches as single steps, and what they leave in the prefix cache. (Every policy with
blocks, random cases: tests/core/test_policy_invariants.py; on the real model: tests/test_multi_step_engine.py.)"""

from cbjax.core import Request, SamplingParams, Scheduler, SchedulerConfig, VirtualClock
from cbjax.core.page_pool import chain_hashes
from cbjax.core.request import PENDING_TOKEN
from tests.core.fake_runner import FakeRunner, reference
from tests.core.scheduler_setup import FlatConfig, make_scheduler

VOCAB, EOS = 40, 0


def config(**kw) -> FlatConfig:
    base = dict(max_num_seqs=4, max_num_batched_tokens=32, page_size=4, num_pages=64, max_model_len=64)
    return FlatConfig(**(base | kw))


def request(i: int, prompt_len: int, max_tokens: int, eos: bool = False) -> Request:
    prompt = [(7 * i + 3 * j) % (VOCAB - 1) + 1 for j in range(prompt_len)]
    return Request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=not eos), 0.0, 0, i)


def run(cfg: SchedulerConfig, reqs: list[Request], asynchronous: bool, arrivals: dict | None = None):
    """Schedule, run on the fake runner and update until everything finished; returns the SchedulerOutputs, each
    with the number of requests that waited when it was planned."""
    return run_on(make_scheduler(cfg, VirtualClock()), reqs, asynchronous, arrivals)


def run_on(s: Scheduler, reqs: list[Request], asynchronous: bool, arrivals: dict | None = None):
    runner = FakeRunner(s, VOCAB)
    for r in reqs:
        s.add(r)
    outs, in_flight, step, arrivals = [], None, 0, arrivals or {}
    while s.has_unfinished() or in_flight or step in arrivals:
        for r in arrivals.get(step, []):
            s.add(r)
        waiting = len(s.waiting)
        out = s.schedule()
        tokens = runner.execute(out)
        outs.append((out, waiting))
        if asynchronous:
            if in_flight is not None:
                s.update(*in_flight, EOS, 0.0)
            in_flight = (out, tokens) if out.seqs else None
        else:
            s.update(out, tokens, EOS, 0.0)
        s.pool.check_consistent()
        step += 1
        assert step < 1000
    assert s.pool.num_free == s.cache.num_pages
    return outs


def test_blocks_give_the_reference_tokens_and_the_single_steps_batches():
    for asynchronous in (False, True):
        singles, blocks = (
            [request(i, 3 + 5 * i, 10 + 3 * i) for i in range(4)],
            [request(i, 3 + 5 * i, 10 + 3 * i) for i in range(4)],
        )
        one = run(config(), singles, asynchronous)
        four = run(config(num_scheduler_steps=4), blocks, asynchronous)
        for a, b in zip(singles, blocks):
            assert (
                a.output_token_ids
                == b.output_token_ids
                == reference(a.prompt_token_ids, a.params.max_tokens, VOCAB, None, 64)
            )
        assert any(out.num_steps == 4 for out, _ in four)
        assert any(1 < out.num_steps < 4 for out, _ in four)  # a block as long as its longest sequence's steps
        assert len(four) < len(one)
        # Unrolled, the blocks are the single steps' batches: the same sequences at the same positions.
        unrolled = []
        for out, _ in four:
            for i in range(out.num_steps):
                unrolled.append(
                    sorted((q.request.request_id, q.num_computed_tokens + i) for q in out.seqs if i < q.num_steps)
                )
        assert unrolled == [sorted((q.request.request_id, q.num_computed_tokens) for q in out.seqs) for out, _ in one]


def test_no_block_while_a_request_waits_or_a_step_holds_a_prefill():
    reqs = [request(i, 6, 30) for i in range(3)]
    late = [request(3, 10, 5), request(4, 40, 5)]
    outs = run(config(num_scheduler_steps=4, max_num_seqs=3), reqs, True, arrivals={6: late})
    assert any(out.num_steps == 4 for out, _ in outs)
    for out, waiting in outs:
        if out.num_steps > 1:
            assert waiting == 0 and all(q.num_new_tokens == 1 and q.samples_token for q in out.seqs)
    # The late requests wait for slots: while they do, the running ones decode a step at a time.
    assert any(waiting and out.num_steps == 1 and len(out.seqs) == 3 for out, waiting in outs)


def test_a_block_stops_at_max_tokens_and_drops_what_follows_an_eos():
    reqs = [request(0, 5, 6), request(1, 5, 3), request(2, 9, 40, eos=True)]
    expected = [
        reference(r.prompt_token_ids, r.params.max_tokens, VOCAB, EOS if i == 2 else None, 64)
        for i, r in enumerate(reqs)
    ]
    outs = run(config(num_scheduler_steps=8), reqs, True)
    assert [r.output_token_ids for r in reqs] == expected
    steps_of = [{q.request.request_id: q.num_steps for q in out.seqs} for out, _ in outs if out.num_steps > 1]
    assert steps_of, "no block"
    # No sequence is given a step past its max_tokens.
    for r in reqs:
        assert sum(1 for out, _ in outs for q in out.seqs if q.request is r for _ in range(q.num_steps)) <= (
            r.params.max_tokens + 2  # (+ the steps an async schedule runs past a stop it has not seen yet)
        )


def test_rows_a_block_computes_for_nothing_are_counted():
    # Synchronous, so the only sampling rows that give no token are a block's: past an EOS inside it, or of a slot
    # idle while the block's longest sequence goes on (no async overrun).
    reqs = [request(i, 4 + i, 30 + 5 * i, eos=True) for i in range(12)]
    s = make_scheduler(config(num_scheduler_steps=8, max_num_seqs=12, max_model_len=128, num_pages=256), VirtualClock())
    outs = run_on(s, reqs, False)
    rows = {r.request_id: 0 for r in reqs}  # sampling rows the device computed for each request
    for out, _ in outs:
        for q in out.seqs:
            if q.samples_token:
                rows[q.request.request_id] += out.num_steps  # (a block computes every slot at every step)
    wasted = {r.request_id: rows[r.request_id] - len(r.output_token_ids) for r in reqs}
    stopped = {r.request_id for r in reqs if r.finish_reason.value == "stop"}
    assert any(wasted[rid] > 0 for rid in stopped), "no request stopped inside a block: pick other prompts"
    assert any(wasted[r.request_id] > 0 for r in reqs if r.request_id not in stopped), "no slot idled in a block"
    assert sum(out.num_wasted_tokens for out, _ in outs) == sum(wasted.values())


def test_no_block_when_the_pool_lacks_the_pages_for_it():
    # Two 7-token prompts on 4-token pages in a pool of 5: their first decodes fit in the 4 pages they hold, a block
    # of 4 would need a third page each.
    reqs = [request(i, 7, 8) for i in range(2)]
    outs = run(config(num_scheduler_steps=4, num_pages=5, max_model_len=16), reqs, False)
    first_decode = outs[1][0]
    assert len(first_decode.seqs) == 2 and first_decode.num_batched_tokens == 2 and first_decode.num_steps == 1
    assert [r.output_token_ids for r in reqs] == [reference(r.prompt_token_ids, 8, VOCAB, None, 16) for r in reqs]


def test_prefix_cache_hashes_only_received_tokens():
    # A block leaves pages whose tokens are pending: registering them then would hash placeholders for good.
    reqs = [request(i, 6, 20) for i in range(2)]
    s = make_scheduler(config(num_scheduler_steps=4, enable_prefix_caching=True), VirtualClock())
    runner = FakeRunner(s, VOCAB)
    for r in reqs:
        s.add(r)
    in_flight = None
    while s.has_unfinished() or in_flight:
        out = s.schedule()
        tokens = runner.execute(out)
        if in_flight is not None:
            s.update(*in_flight, EOS, 0.0)
        in_flight = (out, tokens) if out.seqs else None
        for r in reqs:
            known = r.all_token_ids[: len(r.all_token_ids) - r.num_pending_tokens]
            assert PENDING_TOKEN not in known
            assert r.page_hashes == chain_hashes(known, 4, [], upto=len(r.page_hashes) * 4)
    assert any(r.num_registered_pages > 2 for r in reqs) or s.pool.num_cached_pages > 4
