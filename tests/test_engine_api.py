"""Engine API: bad input, aborts, streaming, sampling reproducibility. One shared small engine."""

import numpy as np
import pytest

from cbjax import LLM, LLMEngine, SamplingParams
from cbjax.model import get_model_config, init_model

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine():
    model = init_model(get_model_config("test-tiny"), seed=0)
    return LLMEngine(model, max_num_seqs=4, max_num_batched_tokens=32, page_size=8, num_pages=48, max_model_len=96)


def drain(engine):
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


BAD_INPUTS = [
    ("empty prompt", lambda e: e.add_request("x", [], SamplingParams()), "empty prompt"),
    ("token id above vocab", lambda e: e.add_request("x", [5, 512], SamplingParams()), "outside the vocabulary"),
    ("negative token id", lambda e: e.add_request("x", [-1, 4], SamplingParams()), "outside the vocabulary"),
    (
        "prompt longer than max_model_len",
        lambda e: e.add_request("x", [5] * 97, SamplingParams()),
        "longer than max_model_len",
    ),
    (
        "prompt + max_tokens beyond max_model_len",
        lambda e: e.add_request("x", [5] * 90, SamplingParams(max_tokens=10)),
        "exceeds max_model_len",
    ),
    ("max_tokens < 1", lambda e: e.add_request("x", [5], SamplingParams(max_tokens=0)), "max_tokens"),
    ("temperature < 0", lambda e: e.add_request("x", [5], SamplingParams(temperature=-0.5)), "temperature"),
    ("top_p above 1", lambda e: e.add_request("x", [5], SamplingParams(top_p=1.5)), "top_p"),
    ("top_p zero", lambda e: e.add_request("x", [5], SamplingParams(top_p=0.0)), "top_p"),
    ("duplicate id", lambda e: e.add_request("ok-0", [5], SamplingParams()), "duplicate request id"),
    ("abort unknown id", lambda e: e.abort_request("nope"), "unknown request id"),
    ("text prompt without tokenizer", lambda e: e.add_request("x", "hello", SamplingParams()), "tokenizer"),
    ("priority not an integer", lambda e: e.add_request("x", [5], SamplingParams(), priority="high"), "priority"),
    ("tenant not a string", lambda e: e.add_request("x", [5], SamplingParams(), tenant=3), "tenant"),
    ("deadline not finite", lambda e: e.add_request("x", [5], SamplingParams(), deadline=float("nan")), "deadline"),
]


@pytest.mark.parametrize("name,call,message", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_is_refused_and_others_still_finish(engine, name, call, message):
    for i in range(3):
        engine.add_request(f"ok-{i}", [3 + i, 7, 9], SamplingParams(max_tokens=5, **GREEDY))
    engine.step()  # the good requests are running when the bad one arrives
    with pytest.raises(ValueError, match=message):
        call(engine)
    done = drain(engine)
    assert sorted(done) == ["ok-0", "ok-1", "ok-2"]
    assert all(len(o.outputs[0].token_ids) == 5 for o in done.values())
    assert engine.scheduler.pool.num_free == engine.scheduler.pool.num_pages


def test_pool_too_small_for_a_request_is_refused():
    model = init_model(get_model_config("test-tiny"), seed=0)
    e = LLMEngine(
        model, max_num_seqs=2, max_num_batched_tokens=16, page_size=8, num_pages=2, max_model_len=64, warmup=False
    )
    with pytest.raises(ValueError, match="KV pages"):
        e.add_request("big", [5] * 10, SamplingParams(max_tokens=10))


def test_llm_generate_reports_bad_prompt_and_serves_the_rest(engine):
    outs = LLM.from_engine(engine).generate([[5, 6], [], [7]], SamplingParams(max_tokens=3, **GREEDY))
    assert [o.outputs[0].finish_reason for o in outs] == ["length", "abort", "length"]
    assert "empty prompt" in outs[1].error and outs[0].error is None
    assert len(outs[2].outputs[0].token_ids) == 3


def test_abort_running_request_frees_pages_and_reports_abort(engine):
    engine.add_request("long", [4] * 20, SamplingParams(max_tokens=60, **GREEDY))
    engine.add_request("short", [5] * 4, SamplingParams(max_tokens=4, **GREEDY))
    for _ in range(3):
        engine.step()
    engine.abort_request("long")
    done = drain(engine)
    assert done["long"].outputs[0].finish_reason == "abort"
    assert done["short"].outputs[0].finish_reason == "length"
    assert engine.scheduler.pool.num_free == engine.scheduler.pool.num_pages
    engine.add_request("long", [4] * 3, SamplingParams(max_tokens=2, **GREEDY))  # the id is free again
    assert drain(engine)["long"].finished


def test_stream_deltas_concatenate_to_the_final_output(engine):
    for i in range(6):
        engine.add_request(f"s{i}", [3 + i] * (1 + 7 * i), SamplingParams(max_tokens=4 + i, **GREEDY))
    pieces, final = {}, {}
    for out in engine.stream():
        pieces.setdefault(out.request_id, []).extend(out.outputs[0].new_token_ids)
        assert len(out.outputs[0].new_token_ids) <= 1
        if out.finished:
            final[out.request_id] = out.outputs[0].token_ids
    assert pieces == final and len(final) == 6


def test_metrics_timestamps_are_ordered(engine):
    outs = LLM.from_engine(engine).generate([[5, 6, 7]] * 3, SamplingParams(max_tokens=4, **GREEDY))
    for o in outs:
        m = o.metrics
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
        assert len(m.token_times) == 4 and m.token_times == sorted(m.token_times)
        assert m.token_times[0] == m.first_token_time and m.token_times[-1] == m.finished_time


def test_stop_token_ends_generation(engine):
    ref = LLM.from_engine(engine).generate([[9, 8, 7]], SamplingParams(max_tokens=8, **GREEDY))[0]
    toks = ref.outputs[0].token_ids
    stop = toks[2]
    out = LLM.from_engine(engine).generate(
        [[9, 8, 7]], SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=[stop])
    )[0]
    assert out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].token_ids == toks[: toks.index(stop) + 1]


def test_same_seed_same_tokens_whatever_the_batch(engine):
    llm = LLM.from_engine(engine)
    sp = SamplingParams(max_tokens=12, temperature=1.0, top_k=50, top_p=0.9, seed=1234, ignore_eos=True)
    alone = llm.generate([[11, 12, 13]], sp)[0].outputs[0].token_ids
    rng = np.random.default_rng(0)
    others = [rng.integers(3, 500, int(rng.integers(1, 40))).tolist() for _ in range(5)]
    other_params = [
        SamplingParams(max_tokens=int(rng.integers(1, 20)), temperature=0.8, ignore_eos=True) for _ in others
    ]
    crowd = llm.generate(others[:2] + [[11, 12, 13]] + others[2:], other_params[:2] + [sp] + other_params[2:])
    assert crowd[2].outputs[0].token_ids == alone
    other_seed = llm.generate([[11, 12, 13]], SamplingParams(max_tokens=12, temperature=1.0, seed=99, ignore_eos=True))[
        0
    ]
    assert other_seed.outputs[0].token_ids != alone


def test_top_k_one_and_tiny_top_p_are_greedy(engine):
    llm = LLM.from_engine(engine)
    prompt = [[21, 22, 23, 24]]
    greedy = llm.generate(prompt, SamplingParams(max_tokens=10, **GREEDY))[0].outputs[0].token_ids
    k1 = llm.generate(prompt, SamplingParams(max_tokens=10, temperature=5.0, top_k=1, seed=3, ignore_eos=True))
    p0 = llm.generate(prompt, SamplingParams(max_tokens=10, temperature=5.0, top_p=1e-6, seed=3, ignore_eos=True))
    assert k1[0].outputs[0].token_ids == greedy
    assert p0[0].outputs[0].token_ids == greedy


def test_high_temperature_sampling_differs_from_greedy(engine):
    llm = LLM.from_engine(engine)
    prompt = [[31, 32, 33]]
    greedy = llm.generate(prompt, SamplingParams(max_tokens=16, **GREEDY))[0].outputs[0].token_ids
    hot = llm.generate(prompt, SamplingParams(max_tokens=16, temperature=3.0, seed=5, ignore_eos=True))
    assert hot[0].outputs[0].token_ids != greedy


def test_unknown_engine_option_is_an_error():
    with pytest.raises(ValueError, match="unknown engine options"):
        LLMEngine("test-tiny", max_num_seq=3)


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(policy="fifo"), "unknown policy 'fifo'; known: .*sarathi"),
        (dict(policy="priority", policy_options={"aging": 1.0}), "takes no option.*aging_s"),
        (dict(policy="sarathi", policy_options={"chunk_size": 0}), "chunk_size must be >= 1"),
        (dict(preemption_mode="swapp"), "preemption_mode must be 'recompute' or 'swap'"),
        (dict(warmup="eager"), "warmup must be one of"),
    ],
)
def test_bad_scheduling_options_fail_before_any_compile(options, message, monkeypatch):
    import cbjax.engine

    def no_runner(*args, **kwargs):
        raise AssertionError("the model runner was built (and compiled) before the bad option was refused")

    monkeypatch.setattr(cbjax.engine, "ModelRunner", no_runner)
    with pytest.raises(ValueError, match=message):
        LLMEngine("test-tiny", **options)


def test_no_compiles_after_warmup_in_this_module(engine):
    engine.wait_until_warm()
    assert engine.num_compiles in (0, len(engine.buckets.token_buckets))


def test_argmax_last_matches_argmax_with_ties_and_odd_vocab():
    import jax.numpy as jnp

    from cbjax.runner.sampler import argmax_last

    rng = np.random.default_rng(0)
    for V in (5, 128, 1000, 32000):
        x = rng.integers(0, 4, (7, V)).astype(np.float32)  # many ties: the first index must win
        assert np.array_equal(np.asarray(argmax_last(jnp.asarray(x))), x.argmax(-1))
