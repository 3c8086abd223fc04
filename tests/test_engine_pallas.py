"""The engine with the Pallas ragged kernel (interpret mode on CPU) is token-exact with the XLA reference."""

from cbjax import LLM, LLMEngine, SamplingParams
from cbjax.model import get_model_config, init_model
from tests.helpers import greedy_reference, random_workload


def test_pallas_interpret_engine_matches_reference_engine():
    model = init_model(get_model_config("test-tiny"), seed=0)
    prompts, params = random_workload(
        6, seed=5, vocab=model.cfg.vocab_size, prompt_range=(1, 60), max_tokens_range=(1, 8)
    )
    opts = dict(max_num_seqs=4, max_num_batched_tokens=32, page_size=8, num_pages=40, max_model_len=72)
    assert max(map(len, prompts)) > opts["max_num_batched_tokens"]  # chunked prefill goes through the kernel too
    ref = LLM.from_engine(LLMEngine(model, attention_backend="xla", **opts)).generate(prompts, params)
    pallas_engine = LLMEngine(model, attention_backend="pallas", pallas_interpret=True, warmup=False, **opts)
    assert pallas_engine.runner.backend == "pallas"
    got = LLM.from_engine(pallas_engine).generate(prompts, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]
    assert pallas_engine.scheduler.pool.num_free == opts["num_pages"]
    sampled = SamplingParams(max_tokens=5, temperature=0.9, top_k=20, seed=7, ignore_eos=True)
    assert (
        LLM.from_engine(pallas_engine).generate([[5, 6, 7]], sampled)[0].outputs[0].token_ids
        == LLM.from_engine(LLMEngine(model, **opts)).generate([[5, 6, 7]], sampled)[0].outputs[0].token_ids
    )


def test_pallas_interpret_engine_with_a_sliding_window_and_eviction_matches_the_full_forward():
    """The Pallas kernel reads only in-window pages: the page table's dropped columns hold the pad page."""
    model = init_model(get_model_config("test-tiny").replace(sliding_window=16), seed=0)
    prompts = [list(range(3, 3 + n)) for n in (40, 21, 9)]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (24, 30, 12)]
    opts = dict(max_num_seqs=4, max_num_batched_tokens=16, page_size=8, num_pages=24, max_model_len=72)
    engine = LLMEngine(model, attention_backend="pallas", pallas_interpret=True, warmup=False, **opts)
    got = LLM.from_engine(engine).generate(prompts, params)
    want = greedy_reference(model, prompts, [p.max_tokens for p in params], width=72)
    assert [o.outputs[0].token_ids for o in got] == want
    assert engine.scheduler.pool.num_free == opts["num_pages"]


def test_pallas_interpret_engine_with_int8_kv_matches_the_quantized_full_forward():
    """kv_cache_dtype="int8" through the dispatcher into the Pallas kernel: the scales reach it, and its greedy
    tokens equal the full forward with K and V rounded through int8 (the XLA path's test is test_int8_kv_engine)."""
    model = init_model(get_model_config("test-tiny"), seed=0)
    prompts = [list(range(3, 3 + n)) for n in (40, 21, 9)]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (12, 8, 10)]
    opts = dict(max_num_seqs=4, max_num_batched_tokens=16, page_size=8, num_pages=24, max_model_len=72)
    engine = LLMEngine(
        model, attention_backend="pallas", pallas_interpret=True, warmup=False, kv_cache_dtype="int8", **opts
    )
    got = LLM.from_engine(engine).generate(prompts, params)
    want = greedy_reference(model, prompts, [p.max_tokens for p in params], width=72, quantize_kv=True)
    assert [o.outputs[0].token_ids for o in got] == want
    assert engine.scheduler.pool.num_free == opts["num_pages"]
