"""Blocks of decode steps whose rows stream (cbjax/runner/token_stream.py): a streaming LLMEngine with
num_scheduler_steps > 1 returns one token per request per step() while the device runs each block in one dispatch.
The tokens equal the full-forward reference and single steps' (greedy, seeded sampling, stop tokens, max_tokens
and aborts inside a block, a request arriving during one), nothing compiles after warmup, no page leaks, and a row
that does not arrive makes the rest of its block come at the block's end, nothing lost."""

import types

import jax
import numpy as np
import pytest

from cbjax import LLMEngine, SamplingParams
from cbjax.model import get_model_config, init_model
from cbjax.runner.token_stream import TokenStream
from cbjax.streamed_rows import RowOutput
from tests.helpers import greedy_reference, random_workload

MAX_MODEL_LEN = 256
OPTS = dict(max_num_seqs=8, max_num_batched_tokens=64, page_size=16, max_model_len=MAX_MODEL_LEN, num_pages=160)

pytestmark = pytest.mark.skipif(
    TokenStream.create(8, 4) is None, reason="no CPU kernel library here: blocks do not stream their rows"
)


@pytest.fixture(scope="module")
def model():
    return init_model(get_model_config("test-tiny"), seed=0)


@pytest.fixture(scope="module")
def engine(model):
    engine = LLMEngine(model, num_scheduler_steps=4, **OPTS)
    engine.wait_until_warm()
    return engine


def stream(engine, requests: dict, on_step=None, read="completion") -> tuple[dict, dict, list[int]]:
    """Add `requests` (id -> (prompt, params)) and step until done, reading every delta. Returns (deltas joined,
    final outputs, the largest delta of each step() call); `on_step(i)` runs before the i-th call. `read`: each
    output's delta read from its completion ("completion"), by `stream_delta()` ("delta": a kept row's outputs never
    build one), every third output's completion and the rest's stream_delta() ("mixed"), or in bulk by
    `step_deltas()` as the server does ("bulk": plain requests' one new token in two lists)."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    deltas, final, sizes, i, kept = {}, {}, [], 0, 0
    while engine.has_unfinished_requests():
        if on_step is not None:
            on_step(i)
        if read == "bulk":
            bulk = engine.step_deltas()
            outs, new = bulk.outputs, [o.stream_delta() for o in bulk.outputs]
            assert len(bulk.request_ids) == len(set(bulk.request_ids)) == len(bulk.token_ids)
            assert not {o.request_id for o in outs} & set(bulk.request_ids), "a request in both parts"
            for rid, token in zip(bulk.request_ids, bulk.token_ids):
                deltas.setdefault(rid, []).append(token)
            kept += len(bulk.request_ids)
        else:
            outs = engine.step()
            kept += sum(isinstance(o, RowOutput) for o in outs)
            new = [
                o.outputs[0].new_token_ids
                if read == "completion" or (read == "mixed" and j % 3 == 1)
                else o.stream_delta()
                for j, o in enumerate(outs)
            ]
        i += 1
        sizes.append(max([0] + [len(d) for d in new] + ([1] if read == "bulk" and bulk.request_ids else [])))
        for o, d in zip(outs, new):
            deltas.setdefault(o.request_id, []).extend(d)
            if o.finished:
                final[o.request_id] = o
    assert kept > 0 or read == "completion", "no row was kept aside (cbjax/streamed_rows.py)"
    return deltas, final, sizes


def check_clean(engine, compiles: int) -> None:
    assert engine.num_compiles == compiles, "compiled after warmup"
    pool = engine.scheduler.pool
    assert pool.num_free == pool.num_pages, "page leak"


@pytest.mark.parametrize("read", ["completion", "delta", "bulk"])
def test_streamed_rows_give_the_reference_tokens_one_per_step(model, engine, read):
    prompts, params = random_workload(8, seed=11, vocab=model.cfg.vocab_size, prompt_range=(1, 90))
    ref = greedy_reference(model, prompts, [p.max_tokens for p in params], width=MAX_MODEL_LEN)
    compiles, first = engine.num_compiles, len(engine.step_records)
    deltas, final, sizes = stream(engine, {f"g{i}": (p, q) for i, (p, q) in enumerate(zip(prompts, params))}, read=read)
    check_clean(engine, compiles)
    got = [final[f"g{i}"].outputs[0].token_ids for i in range(8)]
    assert [i for i, (g, r) in enumerate(zip(got, ref)) if g != r] == []
    assert all(deltas[f"g{i}"] == got[i] for i in range(8))
    records = engine.step_records[first:]
    assert any(r["decode_steps"] > 1 for r in records), "no block of decode steps ran"
    assert max(sizes) == 1, "a block's tokens came together"
    # Every token was received once: a block's record holds all of its rows' waits and host time.
    assert all(r["device_s"] >= 0 and r["host_s"] >= 0 for r in records)


@pytest.mark.parametrize("read", ["completion", "delta", "mixed", "bulk"])
def test_sampled_stopped_aborted_and_arriving_requests_match_single_steps(model, engine, read):
    """Seeded sampling draws from (seed, output index) alone; a stop token or max_tokens inside a block ends the
    request there; an abort inside a block ends it at once; a request added during a block joins after it. Rows
    kept aside (cbjax/streamed_rows.py) are applied before an abort, a stop and a completion read mid-block."""
    prompts, _ = random_workload(6, seed=12, vocab=model.cfg.vocab_size, prompt_range=(4, 40))
    late_prompt = random_workload(1, seed=13, vocab=model.cfg.vocab_size, prompt_range=(4, 40))[0][0]
    sampling = lambda i, n=37, **kw: SamplingParams(
        max_tokens=n, temperature=0.8, top_k=40, seed=200 + i, ignore_eos=True, **kw
    )
    requests = {f"s{i}": (p, sampling(i, n=21 + 3 * i)) for i, p in enumerate(prompts)}
    requests["late"] = (late_prompt, sampling(9))
    single = LLMEngine(model, **OPTS)
    _, want, _ = stream(single, requests, read="bulk" if read == "bulk" else "completion")  # (bulk: builder.deltas)
    want = {rid: o.outputs[0].token_ids for rid, o in want.items()}
    # Stop s1 at its 10th token's value, s2 at its 7th (inside a block of 4, after the prefill's token).
    requests["s1"] = (prompts[1], sampling(1, n=24, stop_token_ids=[want["s1"][9]]))
    requests["s2"] = (prompts[2], sampling(2, n=27, stop_token_ids=[want["s2"][6]]))
    late = requests.pop("late")

    def on_step(i):
        if i == 6:
            engine.add_request("late", *late)
        if i == 9:
            engine.abort_request("s4")

    compiles = engine.num_compiles
    deltas, final, sizes = stream(engine, requests, on_step, read=read)
    check_clean(engine, compiles)
    got = {rid: o.outputs[0].token_ids for rid, o in final.items()}
    for rid in ("s0", "s3", "s5", "late"):
        assert got[rid] == want[rid], rid
    for rid, k in (("s1", 9), ("s2", 6)):
        assert got[rid] == want[rid][: want[rid].index(want[rid][k]) + 1], rid
        assert final[rid].outputs[0].finish_reason == "stop"
    assert final["s4"].outputs[0].finish_reason == "abort"
    assert got["s4"] == want["s4"][: len(got["s4"])] and 0 < len(got["s4"]) < len(want["s4"])
    assert all(deltas[rid] == got[rid] for rid in got)
    assert max(sizes) == 1


def test_a_row_that_does_not_arrive_brings_the_rest_of_its_block_at_its_end(model, engine, monkeypatch):
    prompts, params = random_workload(4, seed=14, vocab=model.cfg.vocab_size, prompt_range=(4, 30))
    ref = greedy_reference(model, prompts, [p.max_tokens for p in params], width=MAX_MODEL_LEN)
    stream_ = engine.runner.token_stream
    take, calls = stream_.take, []

    def flaky_take(pos, n, done, slice_us=0):
        calls.append(pos)
        return None if len(calls) % 5 == 3 else take(pos, n, done, slice_us)

    monkeypatch.setattr(stream_, "take", flaky_take)
    compiles = engine.num_compiles
    deltas, final, sizes = stream(engine, {f"f{i}": (p, q) for i, (p, q) in enumerate(zip(prompts, params))})
    check_clean(engine, compiles)
    assert len(calls) >= 5
    got = [final[f"f{i}"].outputs[0].token_ids for i in range(4)]
    assert got == ref
    assert all(deltas[f"f{i}"] == got[i] for i in range(4))
    assert max(sizes) > 1  # a lost row's block came together at its end


def test_the_ring_hands_over_each_position_once_and_reports_a_lost_one():
    ts = TokenStream.create(8, 2)
    assert ts is not None and ts.cap == 8
    out = (jax.ShapeDtypeStruct((8,), np.int32), jax.ShapeDtypeStruct((), np.int32))  # (the row, the stop flag)
    call = jax.jit(lambda meta, i, row: jax.ffi.ffi_call(ts.target, out)(meta, i, row))
    write = lambda meta, i, row: call(meta, i, row)[0]
    row = np.arange(8, dtype=np.int32) * 3
    base, meta = ts.reserve(3)
    got, stop = call(meta, np.int32(1), row)
    assert np.array_equal(got, row) and stop == 0  # the row passes through; nobody asked the block to stop
    assert np.array_equal(ts.take(base + 1, 5, lambda: True), row[:5])
    assert ts.take(base, 5, lambda: True) is None  # never written (the block ended without it)
    # Off: the call only passes the row through.
    assert np.array_equal(write(TokenStream.off_meta(), np.int32(0), row + 1), row + 1)
    assert ts.take(base, 5, lambda: True) is None
    # A later position in the same slot: the earlier one is lost, not returned.
    later, meta2 = ts.reserve(ts.cap + 2)
    write(meta2, np.int32(base + 1 + ts.cap - later), row + 7)
    assert ts.take(base + 1, 8, lambda: True) is None
    assert np.array_equal(ts.take(base + 1 + ts.cap, 8, lambda: True), row + 7)
    # A stop asked for one block reaches its steps only (and never a block without a stream).
    ts.request_stop(types.SimpleNamespace(stream_base=later, stop_requested=False))
    assert call(meta2, np.int32(3), row)[1] == 1 and call(meta, np.int32(2), row)[1] == 0
    assert call(TokenStream.off_meta(), np.int32(0), row)[1] == 0


def test_rows_a_stop_wastes_are_counted_as_when_the_block_comes_at_once(model, engine):
    """A stop token at row j of a block leaves the rest of the sequence's rows computed for nothing: the step records
    count the same `block_wasted_tokens` whether the rows streamed or came at the block's end."""
    prompts, params = random_workload(6, seed=15, vocab=model.cfg.vocab_size, prompt_range=(4, 30))
    params = [SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True) for _ in params]
    ref = greedy_reference(model, prompts, [30] * 6, width=MAX_MODEL_LEN)
    stops = [SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop_token_ids=[r[5 + i]])
             for i, r in enumerate(ref)]  # fmt: skip
    wasted, tokens = [], []
    for streaming in (True, False):
        engine.stream_rows = streaming
        first = len(engine.step_records)
        try:
            requests = {f"w{streaming}{i}": (p, q) for i, (p, q) in enumerate(zip(prompts, stops))}
            _, final, sizes = stream(engine, requests)
        finally:
            engine.stream_rows = True
        if streaming:
            assert max(sizes) == 1
        wasted.append(sum(r["block_wasted_tokens"] for r in engine.step_records[first:]))
        tokens.append([final[f"w{streaming}{i}"].outputs[0].token_ids for i in range(6)])
    assert tokens[0] == tokens[1] == [r[: r.index(r[5 + i]) + 1] for i, r in enumerate(ref)]
    assert wasted[0] == wasted[1] > 0


def test_rows_that_take_longer_than_a_wait_slice_still_arrive_one_per_step(model, engine, monkeypatch):
    """A step slower than one wait of the ring (TAKE_TIMEOUT_US, 1 us here) is waited for in slices, the block's
    program checked between them (a bigger model's steps outlast the default 20 ms slice)."""
    from cbjax.runner import token_stream

    monkeypatch.setattr(token_stream, "TAKE_TIMEOUT_US", 1)
    prompts, params = random_workload(3, seed=16, vocab=model.cfg.vocab_size, prompt_range=(4, 30))
    ref = greedy_reference(model, prompts, [p.max_tokens for p in params], width=MAX_MODEL_LEN)
    compiles = engine.num_compiles
    deltas, final, sizes = stream(engine, {f"t{i}": (p, q) for i, (p, q) in enumerate(zip(prompts, params))})
    check_clean(engine, compiles)
    assert [final[f"t{i}"].outputs[0].token_ids for i in range(3)] == ref
    assert all(deltas[f"t{i}"] == ref[i] for i in range(3)) and max(sizes) == 1


@pytest.mark.parametrize("read", ["delta", "bulk", "finished"])
def test_a_request_arriving_during_a_block_ends_it_after_its_running_step(model, engine, read, monkeypatch):
    """The block is asked to stop (its device loop reads the ring's stop word after each step): the new request is
    scheduled once the rows the block ran are taken, not at its planned end; the steps it did not run are given
    back (pending tokens, computed counts, pages: none leaks), and every token equals the full-forward reference.
    The request comes as the block is dispatched (the runner's on_dispatch hook), and the stop word is set as its
    positions are reserved, before its program starts: a step of this tiny model is too quick (and a small program
    may even run within its launch) for the test to rely on the device still running when the hook asks.
    "finished": with stream_outputs off (the online harness's way: final outputs only) the rows stream all the same,
    so that an arrival can end a block."""
    prompts, _ = random_workload(5, seed=17, vocab=model.cfg.vocab_size, prompt_range=(4, 30))
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    ref = greedy_reference(model, prompts, [40] * 5, width=MAX_MODEL_LEN)
    compiles, ids = engine.num_compiles, [f"e{read}{i}" for i in range(5)]
    for rid, p in zip(ids[:4], prompts):
        engine.add_request(rid, p, greedy)
    blocks, waited, tokens = [], 0, {}
    ts, reserve = engine.runner.token_stream, engine.runner.token_stream.reserve
    first = engine.requests[ids[0]]
    armed = lambda num_steps: not blocks and len(first.output_token_ids) > 8 and num_steps == 4

    def reserve_stopped(num_steps):  # the target block's stop word set before its first step
        base, meta = reserve(num_steps)
        if armed(num_steps):
            ts.ring[-1] = np.uint32(base).view(np.int32)
        return base, meta

    def on_dispatch(handle):
        if handle.stream_base is not None and armed(handle.out.num_steps):
            blocks.append(handle)
            engine.add_request(ids[4], prompts[4], greedy)

    monkeypatch.setattr(ts, "reserve", reserve_stopped)
    monkeypatch.setattr(engine.runner, "on_dispatch", on_dispatch)
    monkeypatch.setattr(engine, "stream_outputs", read != "finished")
    while engine.has_unfinished_requests():
        for rid, new in read_step(engine, read):
            tokens.setdefault(rid, []).extend(new)
        if blocks and ids[4] in engine.requests and engine.requests[ids[4]].num_computed_tokens == 0:
            waited += 1
    (block,) = blocks  # (none: the block did not stream its rows)
    check_clean(engine, compiles)
    assert [tokens[rid] for rid in ids] == ref
    assert block.stop_requested and block.out.num_steps == 1, "the block did not end after its first step"
    # It waited for the call that dispatched the block and the one that took its one row; the next scheduled it.
    assert waited == 2


def read_step(engine, read: str) -> list[tuple[str, list[int]]]:
    """One step's deltas, (request id, new tokens) each: by `step()` and `stream_delta()`, by step_deltas(), or
    ("finished", stream_outputs off) each finished request's tokens."""
    if read == "finished":
        outputs = engine.step()
        assert all(o.finished for o in outputs), "an unfinished request's output with stream_outputs off"
        return [(o.request_id, o.outputs[0].token_ids) for o in outputs]
    if read != "bulk":
        return [(o.request_id, o.stream_delta()) for o in engine.step()]
    bulk = engine.step_deltas()
    return [*zip(bulk.request_ids, ([t] for t in bulk.token_ids))] + [
        (o.request_id, o.stream_delta()) for o in bulk.outputs
    ]


def test_the_online_harness_runs_streaming_blocks_to_the_reference_tokens(model, engine, monkeypatch):
    """The online harness (cbjax/bench/online.py) reads final outputs only (stream_outputs off); a block's rows
    stream all the same (LLMEngine.stream_rows), so that an arrival can end it. A call that takes a row then returns
    nothing while the block is still in flight, and the harness must count it as progress (it once took it for an
    idle engine and stopped: "online loop stalled"). Requests arriving over the run get the reference tokens."""
    from cbjax.bench.online import run_online
    from cbjax.bench.requests import WorkloadRequest

    prompts, _ = random_workload(6, seed=23, vocab=model.cfg.vocab_size, prompt_range=(4, 30))
    ref = greedy_reference(model, prompts, [24] * 6, width=MAX_MODEL_LEN)
    workload = [WorkloadRequest(f"h{i}", 0.003 * i, tuple(p), 24) for i, p in enumerate(prompts)]
    compiles, rows, fetch_row = engine.num_compiles, [], engine.runner.fetch_row
    monkeypatch.setattr(engine.runner, "fetch_row", lambda handle: rows.append(handle) or fetch_row(handle))
    try:
        result = run_online(engine, workload)
    finally:
        engine.stream_outputs = True
    assert rows, "no block streamed its rows"
    assert [result.output_token_ids[f"h{i}"] for i in range(6)] == ref
    check_clean(engine, compiles)
