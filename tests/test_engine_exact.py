"""Token-exactness of the engine against the full-sequence greedy oracle, under every batch mix we make."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from cbjax import LLM, LLMEngine
from cbjax.model import get_model_config, init_model
from tests.helpers import greedy_reference, random_workload

MAX_MODEL_LEN = 368  # prompts up to 300 + outputs up to 64, and a little slack
OPTS = dict(max_num_seqs=8, max_num_batched_tokens=64, page_size=16, max_model_len=MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def model():
    return init_model(get_model_config("test-tiny"), seed=0)


@pytest.fixture(scope="module")
def workload(model):
    prompts, params = random_workload(40, seed=1, vocab=model.cfg.vocab_size)
    ref = greedy_reference(model, prompts, [p.max_tokens for p in params], width=MAX_MODEL_LEN)
    return prompts, params, ref


def run_and_check(engine: LLMEngine, prompts, params, ref):
    engine.wait_until_warm()
    compiles_after_warmup = engine.num_compiles
    outs = LLM.from_engine(engine).generate(prompts, params)
    got = [o.outputs[0].token_ids for o in outs]
    mismatches = [i for i, (g, r) in enumerate(zip(got, ref)) if g != r]
    assert not mismatches, f"requests {mismatches} differ from the full-forward reference"
    assert all(o.outputs[0].finish_reason == "length" and o.finished for o in outs)
    assert engine.num_compiles == compiles_after_warmup, "compiled after warmup"
    pool = engine.scheduler.pool
    assert pool.num_free == pool.num_pages, "page leak"
    pool.check_consistent()
    return engine


@pytest.mark.parametrize(
    "async_scheduling, cpu_matmul",
    [(True, "auto"), (False, "auto"), (True, "xla")],
    ids=["async", "sync", "async-xla_matmul"],
)
@pytest.mark.parametrize("policy", ["fcfs", "static"])
def test_greedy_tokens_equal_full_forward(model, workload, policy, async_scheduling, cpu_matmul):
    # cpu_matmul "auto" runs the packed C++ matmul on CPU (where it builds); the oracle keeps XLA's dot.
    prompts, params, ref = workload
    engine = LLMEngine(
        model, policy=policy, num_pages=256, async_scheduling=async_scheduling, cpu_matmul=cpu_matmul, **OPTS
    )
    engine = run_and_check(engine, prompts, params, ref)
    steps = engine.step_records
    assert engine.scheduler.num_preemptions == 0
    # the run really mixed prefill chunks with decodes and chunked long prompts
    assert max(s["num_scheduled_seqs"] for s in steps) == OPTS["max_num_seqs"]


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_greedy_tokens_exact_under_preemption(model, workload, async_scheduling):
    prompts, params, ref = workload
    engine = run_and_check(
        LLMEngine(model, num_pages=40, async_scheduling=async_scheduling, **OPTS), prompts, params, ref
    )
    assert engine.scheduler.num_preemptions > 0, "the small pool was meant to force preemption"


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_stop_tokens_end_requests_at_the_same_token(model, workload, async_scheduling):
    """A stop token ends a request at its first occurrence. Asynchronously, the step after it was already
    scheduled (and ran) when the stop is seen: its token is dropped and its pages come back all the same."""
    prompts, params, ref = workload
    stops = [r[len(r) // 2] for r in ref]
    want = [r[: r.index(t) + 1] for r, t in zip(ref, stops)]
    params = [dataclasses.replace(p, stop_token_ids=(t,)) for p, t in zip(params, stops)]
    engine = LLMEngine(model, num_pages=256, async_scheduling=async_scheduling, **OPTS)
    outs = LLM.from_engine(engine).generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert all(o.outputs[0].finish_reason == "stop" for o in outs)
    assert engine.scheduler.pool.num_free == engine.scheduler.pool.num_pages


def test_continuous_batching_takes_fewer_steps_than_static(model, workload):
    prompts, params, _ = workload
    steps = {}
    for policy in ("fcfs", "static"):
        engine = LLMEngine(model, policy=policy, num_pages=256, **OPTS)
        for i, (p, sp) in enumerate(zip(prompts, params)):
            engine.add_request(str(i), p, sp)
        while engine.has_unfinished_requests():
            engine.step()
        steps[policy] = len(engine.step_records)
    assert steps["fcfs"] < steps["static"]


def test_bf16_matmuls_match_their_full_forward_up_to_near_ties():
    """matmul_dtype="bfloat16": the linear layers hold bf16 weights and take bf16 inputs (f32 accumulation).

    The engine's attention (paged, online softmax) and the full forward's (dense) sum in different orders; in f32
    that stays far below any logit margin, but rounding the attention output to bf16 for o_proj can move a logit
    by ~1e-2. So greedy tokens must equal the full forward's until a step where the reference's own top two
    logits are that close, and not otherwise."""
    model = init_model(get_model_config("test-tiny").replace(matmul_dtype="bfloat16"), seed=0)
    assert model.layers[0].mlp.gate_up_proj.kernel[...].dtype == jnp.bfloat16
    assert model.embed.embedding[...].dtype == jnp.float32
    prompts, params = random_workload(12, seed=2, vocab=model.cfg.vocab_size)
    ref = greedy_reference(model, prompts, [p.max_tokens for p in params], width=MAX_MODEL_LEN)
    engine = LLMEngine(model, num_pages=256, **OPTS)
    got = [o.outputs[0].token_ids for o in LLM.from_engine(engine).generate(prompts, params)]
    assert engine.scheduler.pool.num_free == engine.scheduler.pool.num_pages
    exact = 0
    for prompt, g, r in zip(prompts, got, ref):
        i = next((i for i, (a, b) in enumerate(zip(g, r)) if a != b), None)
        if i is None:
            exact += 1
            continue
        logits = np.asarray(model.forward_full(jnp.asarray([prompt + r[:i]]))[0, -1])
        margin = abs(logits[r[i]] - logits[g[i]])
        assert margin < 0.05, f"diverged at token {i} where the reference's margin is {margin}, not a near-tie"
    assert exact >= len(prompts) * 3 // 4


def test_lm_head_on_the_first_rows_or_on_all_slots(model):
    """A step whose bucket has more than HEAD_ROWS slots runs the LM head and the sampler on its first HEAD_ROWS
    rows when its sequences fit there, else on all S slots: both branches, token-exact."""
    from cbjax.runner.head_sample import HEAD_ROWS

    # Many short requests decoding together (more than HEAD_ROWS sequences), then long prompts whose prefill
    # chunks fill big buckets with few sequences.
    short = random_workload(HEAD_ROWS + 16, seed=2, vocab=model.cfg.vocab_size, prompt_range=(1, 8))
    long = random_workload(4, seed=3, vocab=model.cfg.vocab_size, prompt_range=(200, 300), max_tokens_range=(8, 16))
    prompts, params = short[0] + long[0], short[1] + long[1]
    ref = greedy_reference(model, prompts, [p.max_tokens for p in params], width=MAX_MODEL_LEN)
    opts = dict(OPTS, max_num_seqs=2 * HEAD_ROWS, max_num_batched_tokens=4 * HEAD_ROWS)
    engine = run_and_check(LLMEngine(model, num_pages=512, **opts), prompts, params, ref)
    slots = [(min(s["padded_tokens"], opts["max_num_seqs"]), s["num_scheduled_seqs"]) for s in engine.step_records]
    assert any(S > HEAD_ROWS and n <= HEAD_ROWS for S, n in slots), "no step took the first-rows branch"
    assert any(n > HEAD_ROWS for S, n in slots), "no step took the all-slots branch"
