"""The engine with kv_cache_dtype="int8": greedy tokens equal the full forward whose K and V are rounded through
the same int8 quantization (Llama.forward_full(quantize_kv=True)), under preemption by recompute and by swap
(scales travel with their pages), with the prefix cache; no page leak, no compile after warmup; the memory budget
holds more pages; bad options are refused."""

import jax.numpy as jnp
import numpy as np
import pytest

from cbjax import LLM, EngineConfig, LLMEngine, SamplingParams
from cbjax.model import get_model_config, init_model
from cbjax.model.llama import kv_cache_bytes_per_page
from tests.helpers import greedy_reference, random_workload
from tests.test_engine_exact import MAX_MODEL_LEN, OPTS, run_and_check


@pytest.fixture(scope="module")
def model():
    return init_model(get_model_config("test-tiny"), seed=0)


@pytest.fixture(scope="module")
def workload(model):
    prompts, params = random_workload(24, seed=5, vocab=model.cfg.vocab_size)
    ref = greedy_reference(model, prompts, [p.max_tokens for p in params], width=MAX_MODEL_LEN, quantize_kv=True)
    return prompts, params, ref


@pytest.mark.parametrize(
    "options",
    [
        dict(num_pages=256),
        dict(num_pages=40, preemption_mode="recompute", enable_prefix_caching=True),
        dict(num_pages=40, preemption_mode="swap", num_host_pages=64, async_scheduling=False),
        dict(num_pages=40, speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}),
    ],
    ids=["roomy", "recompute+prefix", "swap", "ngram-drafts"],
)
def test_int8_kv_greedy_tokens_equal_the_quantized_full_forward(model, workload, options):
    prompts, params, ref = workload
    engine = LLMEngine(model, kv_cache_dtype="int8", **OPTS, **options)
    assert engine.runner.kv_caches[0][0].dtype == jnp.int8 and len(engine.runner.kv_caches[0]) == 4
    run_and_check(engine, prompts, params, ref)
    if options["num_pages"] == 40:
        assert engine.scheduler.num_preemptions > 0, "the small pool was meant to force preemption"
    if options.get("preemption_mode") == "swap":
        assert engine.scheduler.num_swapped_in_pages > 0
    if "speculative_config" in options:  # drafts were verified against int8 pages, some accepted
        assert sum(s["spec_draft_tokens"] for s in engine.step_records) > 0
        assert sum(s["spec_accepted_tokens"] for s in engine.step_records) > 0


def test_int8_kv_differs_from_float_somewhere(model, workload):
    """The quantized oracle is not the float one on this workload (else the test above proves nothing new)."""
    prompts, params, ref = workload
    float_ref = greedy_reference(model, prompts, [p.max_tokens for p in params], width=MAX_MODEL_LEN)
    assert float_ref != ref


def test_memory_budget_holds_more_int8_pages(model):
    cfg = model.cfg
    f32 = kv_cache_bytes_per_page(cfg, 16)
    int8 = kv_cache_bytes_per_page(cfg, 16, "int8")
    H = cfg.dim_per_head
    assert f32 / int8 == pytest.approx(4 * H / (H + 4))
    budget = dict(kv_cache_memory_gib=0.001, max_num_seqs=4, max_num_batched_tokens=32, warmup="none")
    pages = {dt: LLMEngine(model, kv_cache_dtype=dt, **budget).config.cache.num_pages for dt in ("auto", "int8")}
    assert pages["int8"] == int(0.001 * 2**30) // int8 and pages["auto"] == int(0.001 * 2**30) // f32


def test_bad_kv_cache_dtype_is_a_value_error():
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig.from_options(kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig.from_options(kv_cache_dtype=8)
    assert EngineConfig.from_options(kv_cache_dtype="int8").cache.kv_cache_dtype == "int8"


def test_generate_returns_text_with_int8_kv(model):
    """The LLM facade takes the option too (random model: only the shape of the answer is checked)."""
    llm = LLM(model, kv_cache_dtype="int8", num_pages=64, max_num_seqs=4, max_num_batched_tokens=32, warmup="none")
    prompts = [list(np.arange(5, 25)), [7, 8, 9]]
    outs = llm.generate(prompts, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in outs] == [5, 5]
