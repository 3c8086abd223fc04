"""Blocks of decode steps (num_scheduler_steps, cbjax/core/multi_step.py) on the real engine: the greedy tokens equal
the full-forward reference, sampled and stopped requests get the tokens single steps give them, streams deliver
every token, and nothing compiles after warmup."""

import pytest

from cbjax import LLM, LLMEngine, SamplingParams
from cbjax.model import get_model_config, init_model
from tests.helpers import greedy_reference, random_workload

MAX_MODEL_LEN = 256
OPTS = dict(max_num_seqs=8, max_num_batched_tokens=64, page_size=16, max_model_len=MAX_MODEL_LEN, num_pages=160)


@pytest.fixture(scope="module")
def model():
    return init_model(get_model_config("test-tiny"), seed=0)


@pytest.fixture(scope="module")
def workload(model):
    prompts, params = random_workload(16, seed=3, vocab=model.cfg.vocab_size, prompt_range=(1, 120))
    ref = greedy_reference(model, prompts, [p.max_tokens for p in params], width=MAX_MODEL_LEN)
    return prompts, params, ref


def generate(engine: LLMEngine, prompts, params) -> list[list[int]]:
    engine.wait_until_warm()
    compiles = engine.num_compiles
    outs = LLM.from_engine(engine).generate(prompts, params)
    assert engine.num_compiles == compiles, "compiled after warmup"
    pool = engine.scheduler.pool
    assert pool.num_free == pool.num_pages, "page leak"
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_greedy_tokens_equal_full_forward_with_blocks(model, workload, async_scheduling):
    prompts, params, ref = workload
    engine = LLMEngine(model, num_scheduler_steps=4, async_scheduling=async_scheduling, **OPTS)
    got = generate(engine, prompts, params)
    assert [i for i, (g, r) in enumerate(zip(got, ref)) if g != r] == []
    blocks = [s for s in engine.step_records if s["decode_steps"] > 1]
    assert blocks, "no block of decode steps ran"
    assert max(s["num_scheduled_seqs"] for s in blocks) > 1


def test_sampled_and_stopped_requests_match_single_steps(model):
    """Seeded sampling draws from (seed, output index) alone, so a block samples what single steps sample; a stop
    token inside a block ends the request there (the block's later tokens are dropped)."""
    prompts, _ = random_workload(8, seed=5, vocab=model.cfg.vocab_size, prompt_range=(4, 40))
    sampling = lambda i, **stop: SamplingParams(
        max_tokens=40, temperature=0.9, top_k=50, seed=100 + i, ignore_eos=True, **stop
    )
    params = [sampling(i) for i in range(8)]
    single = generate(LLMEngine(model, **OPTS), prompts, params)
    # Stop each request at its 11th sampled token's value (at its first occurrence, which may come earlier).
    stops = [sampling(i, stop_token_ids=[t[10]]) for i, t in enumerate(single)]
    engine = LLMEngine(model, num_scheduler_steps=4, **OPTS)
    assert generate(engine, prompts, params) == single
    first = len(engine.step_records)
    stopped = generate(engine, prompts, stops)
    assert stopped == [t[: t.index(t[10]) + 1] for t in single]
    records = engine.step_records[first:]
    assert any(s["decode_steps"] > 1 for s in records)
    # The rows blocks computed for nothing (past a stop, or of a slot idle till the block's end) reach the records:
    # at most 3 per sequence and block.
    wasted = [s["block_wasted_tokens"] for s in records]
    assert sum(wasted) > 0
    assert all(w <= 3 * s["num_scheduled_seqs"] for w, s in zip(wasted, records))


def test_the_offline_facade_runs_blocks_by_default_and_the_engine_does_not(model):
    assert LLM(model, warmup="none", **OPTS).engine.config.scheduler.num_scheduler_steps == 8
    assert LLM(model, warmup="none", num_scheduler_steps=1, **OPTS).engine.config.scheduler.num_scheduler_steps == 1
    assert LLMEngine(model, warmup="none", **OPTS).config.scheduler.num_scheduler_steps == 1


def test_stream_deltas_of_blocks_concatenate_to_the_output(model):
    engine = LLMEngine(model, num_scheduler_steps=4, **OPTS)
    engine.wait_until_warm()
    prompts, _ = random_workload(4, seed=9, vocab=model.cfg.vocab_size, prompt_range=(4, 20))
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(max_tokens=31, temperature=0.0, ignore_eos=True))
    streamed, final, sizes = {}, {}, []
    for out in engine.stream():
        streamed.setdefault(out.request_id, []).extend(out.outputs[0].new_token_ids)
        sizes.append(len(out.outputs[0].new_token_ids))
        if out.finished:
            final[out.request_id] = out.outputs[0].token_ids
    assert streamed == final and all(len(t) == 31 for t in final.values())
    # A block's rows stream one per step() on the CPU (runner/token_stream.py, tests/test_streamed_blocks.py), else
    # its tokens arrive together.
    assert max(sizes) == (1 if engine.runner.token_stream is not None else 4)
    # 30 decode steps after the prefill's token: blocks of 4 and a shorter one (the program's loop runs as many
    # steps as the block's longest sequence takes).
    assert {s["decode_steps"] for s in engine.step_records} >= {4, 2}
    ref = greedy_reference(model, prompts, [31] * 4, width=MAX_MODEL_LEN)
    assert [final[str(i)] for i in range(4)] == ref
