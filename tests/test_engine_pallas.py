"""The engine with the Pallas ragged kernel (interpret mode on CPU) is token-exact with the XLA reference."""

from cbjax import LLM, LLMEngine, SamplingParams
from cbjax.model import get_model_config, init_model
from tests.helpers import random_workload


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
