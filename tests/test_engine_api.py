"""Engine API: bad input, aborts, streaming, sampling reproducibility. One shared small engine."""

import numpy as np
import pytest

from cbjax import LLM, LLMEngine, SamplingParams
from cbjax.model import get_model_config, init_model
from tests.helpers import SMALL_ENGINE, drain

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine():
    model = init_model(get_model_config("test-tiny"), seed=0)
    return LLMEngine(model, **SMALL_ENGINE)


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
    # Silently converted to token ids before the validation layer (issue 17):
    ("prompt of floats", lambda e: e.add_request("x", [1.0, 2.5]), "prompt must hold integer token ids; it holds 1.0"),
    ("prompt of bytes", lambda e: e.add_request("x", b"abc"), "prompt must be a sequence of integer token ids"),
    ("prompt of bools", lambda e: e.add_request("x", [True, 5]), "it holds True"),
    ("prompt None", lambda e: e.add_request("x", None), "prompt must be a sequence"),
    ("numpy float prompt", lambda e: e.add_request("x", np.array([3.0, 4.0])), "integer token ids"),
    ("stop id outside vocab", lambda e: e.add_request("x", [5], SamplingParams(stop_token_ids=[512])), "stop_token"),
    ("request id not a string", lambda e: e.add_request(7, [5]), "request_id must be a string"),
    ("request id unhashable", lambda e: e.add_request(["x"], [5]), "request_id must be a string"),
    ("params not SamplingParams", lambda e: e.add_request("x", [5], {"max_tokens": 3}), "SamplingParams"),
    ("arrival time NaN", lambda e: e.add_request("x", [5], arrival_time=float("nan")), "arrival_time"),
    ("priority a bool", lambda e: e.add_request("x", [5], priority=True), "priority must be an integer"),
    ("abort an unhashable id", lambda e: e.abort_request({"x": 1}), "unknown request id"),
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


def test_llm_generate_serves_the_rest_when_a_prompt_is_not_a_sequence(engine):
    llm = LLM.from_engine(engine)
    sp = SamplingParams(max_tokens=2, **GREEDY)
    outs = llm.generate([[5, 6], None, [1.5], b"ab", np.array([3, 4])], sp)
    assert [o.outputs[0].finish_reason for o in outs] == ["length", "abort", "abort", "abort", "length"]
    assert "got None" in outs[1].error and "holds 1.5" in outs[2].error and "bytes" in outs[3].error
    assert outs[4].prompt_token_ids == [3, 4]
    assert not engine.has_unfinished_requests() and not engine.requests  # nothing left for the next call
    assert engine.scheduler.pool.num_free == engine.scheduler.pool.num_pages
    assert outs[0].outputs[0].token_ids == llm.generate([[5, 6]], sp)[0].outputs[0].token_ids


@pytest.mark.parametrize(
    "prompts, params, message",
    [
        (None, None, "prompts must be a string or a list of prompts, got NoneType"),
        ([5, 6, 7], None, "flat list of token ids"),
        ([[5]], [SamplingParams(), SamplingParams()], "2 sampling params for 1 prompts"),
        ([[5]], "greedy", "sampling_params must be SamplingParams or a list"),
        ([[5]], SamplingParams(), None),  # use_tqdm="yes" below
    ],
)
def test_llm_generate_refuses_a_malformed_call_before_queueing_anything(engine, prompts, params, message):
    llm = LLM.from_engine(engine)
    with pytest.raises(ValueError, match=message or "use_tqdm must be True or False"):
        llm.generate(prompts, params, **({} if message else {"use_tqdm": "yes"}))
    assert not engine.requests and not engine.has_unfinished_requests()


def test_llm_generate_interrupted_leaves_nothing_queued(engine, monkeypatch):
    llm = LLM.from_engine(engine)
    real_step, calls = engine.step, []

    def step_then_ctrl_c():
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real_step()

    monkeypatch.setattr(engine, "step", step_then_ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([[5] * 4, [6] * 5], SamplingParams(max_tokens=20, **GREEDY))
    monkeypatch.undo()
    drain(engine)  # the aborted requests report once; nothing of theirs runs
    assert not engine.requests and engine.scheduler.pool.num_free == engine.scheduler.pool.num_pages
    out = llm.generate([[7, 8]], SamplingParams(max_tokens=3, **GREEDY))
    assert [o.request_id for o in out] == [str(llm.num_submitted - 1)] and len(out[0].outputs[0].token_ids) == 3


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


def test_without_streaming_only_finished_requests_get_outputs(engine):
    """stream_outputs=False (the benchmark harness's mode): a step reports the requests that finished, each once,
    with every token; the same tokens as when streaming."""
    prompts = [[3 + i] * (1 + 5 * i) for i in range(5)]
    runs = {}
    for stream in (True, False):
        engine.stream_outputs = stream
        try:
            for i, p in enumerate(prompts):
                engine.add_request(f"n{stream}{i}", p, SamplingParams(max_tokens=3 + i, **GREEDY))
            seen = [out for out in engine.stream()]
        finally:
            engine.stream_outputs = True
        assert all(out.finished for out in seen) != stream
        runs[stream] = {out.request_id[-1]: out.outputs[0].token_ids for out in seen if out.finished}
    assert runs[True] == runs[False] and len(runs[False]) == 5


def test_generate_builds_final_outputs_only_and_restores_streaming(engine):
    """LLM.generate keeps finished outputs only, so it steps without per-token outputs (as the harness does) and
    puts the engine's stream_outputs back as it found it; the tokens are those of a streaming run."""
    prompts = [[4 + i] * (2 + 3 * i) for i in range(4)]
    params = [SamplingParams(max_tokens=2 + i, **GREEDY) for i in range(4)]
    llm, streamed = LLM.from_engine(engine), []
    step = engine.step

    def recording_step():
        streamed.append(engine.stream_outputs)
        return step()

    engine.step = recording_step
    try:
        for before in (True, False):
            engine.stream_outputs = before
            outs = llm.generate(prompts, params)
            assert engine.stream_outputs is before
            assert [len(o.outputs[0].token_ids) for o in outs] == [2, 3, 4, 5]
    finally:
        del engine.step
        engine.stream_outputs = True
    assert streamed and not any(streamed)
    for p, sp, out in zip(prompts, params, outs):
        engine.add_request("s" + out.request_id, p, sp)
    final = {o.request_id[1:]: o.outputs[0].token_ids for o in engine.stream() if o.finished}
    assert final == {o.request_id: o.outputs[0].token_ids for o in outs}


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
        (dict(policy="fifo"), r"policy must be one of \[.*sarathi.*got 'fifo'"),
        (dict(policy="priority", policy_options={"aging": 1.0}), "takes no option.*aging_s"),
        (dict(policy="sarathi", policy_options={"chunk_size": 0}), "chunk_size must be an integer >= 1, got 0"),
        (dict(preemption_mode="swapp"), r"preemption_mode must be one of \['recompute', 'swap'\]"),
        (dict(warmup="eager"), "warmup must be one of"),
    ],
)
def test_bad_scheduling_options_fail_before_any_compile(options, message, monkeypatch):
    import cbjax.engine_build

    def no_runner(*args, **kwargs):
        raise AssertionError("the model runner was built (and compiled) before the bad option was refused")

    monkeypatch.setattr(cbjax.engine_build, "build_model_runner", no_runner)
    with pytest.raises(ValueError, match=message):
        LLMEngine("test-tiny", **options)


@pytest.mark.parametrize(
    "options, message",
    [
        # The examples of issue 17, each silently accepted (or a raw crash) before the validation layer.
        (dict(kv_cache_memory_gib=-1), "kv_cache_memory_gib must be a finite number > 0.0, got -1"),
        (dict(max_model_len=0), "max_model_len must be an integer >= 1, got 0"),
        (dict(max_num_seqs=2.5), "max_num_seqs must be an integer >= 1, got 2.5 \\(float\\)"),
        (dict(page_size=0), "page_size must be an integer >= 1, got 0"),
        (dict(max_num_seqs=True), "max_num_seqs must be an integer >= 1, got True \\(bool\\)"),
        (dict(watermark_fraction=1.5), "watermark_fraction must be a finite number >= 0.0 and < 1.0"),
        (dict(swap_space_gib=float("nan")), "swap_space_gib"),
        (dict(seed=-1), "seed must be an integer >= 0"),
        (dict(dtype="float7"), "dtype must be one of"),
        (dict(enable_prefix_caching="yes"), "enable_prefix_caching must be True or False"),
        (dict(policy_options=["aging_s"]), "policy_options must be a dict"),
        (dict(policy="priority", policy_options={"aging_s": "slow"}), "priority aging_s .*got 'slow'"),
        (dict(policy="fair_share", policy_options={"tenant_weights": {"a": 0}}), "tenant_weights\\['a'\\]"),
        (dict(compilation_cache=""), "compilation_cache"),
        (dict(max_num_seqs=4, bogus=1), "unknown engine options: \\['bogus'\\]"),
    ],
)
def test_bad_engine_options_fail_before_the_model_is_loaded(options, message, monkeypatch):
    import cbjax.engine_build

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the bad option was refused")

    monkeypatch.setattr(cbjax.engine_build, "load_model", no_model)
    with pytest.raises(ValueError, match=message):
        LLMEngine("test-tiny", **options)


def test_options_the_model_decides_are_checked_against_it():
    with pytest.raises(ValueError, match="max_model_len=2048 exceeds the model's max_position_embeddings \\(1024\\)"):
        LLMEngine("test-tiny", max_model_len=2048, warmup="none")
    with pytest.raises(ValueError, match="kv_cache_memory_gib=1e-09 holds no KV page"):
        LLMEngine("test-tiny", kv_cache_memory_gib=1e-9, warmup="none")
    # GiB taken for bytes: more than this machine has, refused before anything is allocated.
    with pytest.raises(ValueError, match=r"the KV cache .* GiB, more than the .* GiB of memory"):
        LLMEngine("test-tiny", kv_cache_memory_gib=4e9, warmup="none")
    with pytest.raises(ValueError, match="the host swap pool"):
        LLMEngine("test-tiny", num_pages=8, preemption_mode="swap", num_host_pages=10**12, warmup="none")


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
