"""Speculative decoding with a draft model (method "draft") on the real engine: greedy outputs equal the
full-forward reference token for token for every policy in both preemption modes with the prefix cache on and a
pool small enough to preempt; the draft's KV follows the target's page tables through all of it (a draft with the
target's own weights has every draft accepted); nothing leaks, nothing compiles after warmup; bad drafts are a
ValueError before anything is built. (The sampled distribution: tests/test_speculative_sampling.py.)"""

import json
import os
import shutil

import numpy as np
import pytest

from cbjax import LLM, LLMEngine, SamplingParams
from cbjax.core.policy_zoo import POLICIES
from cbjax.model import get_model_config, init_model
from cbjax.model.registry import packaged_model_path
from tests.helpers import noisy_copy
from tests.test_policy_engine_exact import OPTS, model, run_staggered, workload  # noqa: F401 (fixtures)
from tests.test_speculative_engine import check_exact_with_drafts_under_preemption

K = 3


def draft_spec(draft, k: int = K, **more):
    return dict(method="draft", draft_model=draft, num_speculative_tokens=k, **more)


@pytest.fixture(scope="module")
def noisy_draft(model):  # noqa: F811
    return noisy_copy(model, 0.5, seed=1)


def preempting_engine(model, draft, policy, mode):  # noqa: F811
    return LLMEngine(
        model,
        speculative_config=draft_spec(draft),
        policy=policy,
        preemption_mode=mode,
        num_host_pages=64 if mode == "swap" else None,
        enable_prefix_caching=True,
        **OPTS,
    )


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_every_policy_is_token_exact_with_a_draft_model_under_preemption(model, noisy_draft, workload, policy, mode):  # noqa: F811
    reqs, ref = workload
    engine = preempting_engine(model, noisy_draft, policy, mode)
    check_exact_with_drafts_under_preemption(engine, reqs, ref, f"{policy}/{mode}")
    assert engine.runner.draft.num_prefill_tokens > 0  # the draft caught up on contexts


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_draft_with_the_targets_weights_has_every_draft_accepted(model, workload, mode):  # noqa: F811
    """The draft's KV must hold exactly the target's context at every step (after catch-up prefills, accepted
    and rejected drafts, preemption by recompute or swap, prefix-cache hits): with the target's own weights as the
    draft, any stale or misplaced draft K/V would show as a rejected draft."""
    reqs, ref = workload
    engine = preempting_engine(model, model, "priority", mode)
    got = run_staggered(engine, reqs)
    assert [got[i] for i in range(len(reqs))] == ref
    spec = engine.scheduler.speculator
    assert engine.scheduler.num_preemptions > 0 and engine.scheduler.pool.hit_tokens > 0
    assert spec.num_draft_tokens > 100
    # Float rounding differs between the draft's decode rows and the target's verify rows; a near tie may flip.
    assert spec.acceptance_rate >= 0.98, f"acceptance {spec.acceptance_rate:.3f} with the target as its own draft"


def test_adaptive_draft_length_and_no_drafts_steps_keep_outputs(model, noisy_draft, workload):  # noqa: F811
    """A batch-size table that turns drafting off above 2 sequences: steps without drafts run the plain program
    (the draft computes nothing), and the draft catches up when a sequence speculates again."""
    reqs, ref = workload
    table = {"1-2": K, "3-": 0}
    spec = draft_spec(noisy_draft, draft_length="batch_size", draft_length_table=table)
    engine = LLMEngine(model, speculative_config=spec, **OPTS)
    got = run_staggered(engine, reqs)
    assert [got[i] for i in range(len(reqs))] == ref
    steps = engine.step_records
    assert any(s["spec_draft_tokens"] for s in steps) and any(not s["spec_draft_tokens"] for s in steps)
    assert engine.scheduler.pool.num_free == engine.scheduler.pool.num_pages


def test_sampled_requests_with_a_draft_model_are_deterministic_per_seed(model, noisy_draft, workload):  # noqa: F811
    reqs, _ = workload
    prompts = [r["prompt"] for r in reqs[:8]]
    params = [
        SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=i, ignore_eos=True) for i in range(len(prompts))
    ]
    runs = [LLM(model, speculative_config=draft_spec(noisy_draft), **OPTS).generate(prompts, params) for _ in range(2)]
    first, second = ([o.outputs[0].token_ids for o in run] for run in runs)
    assert first == second
    assert all(len(t) == 16 for t in first)


def test_sample_and_match_keeps_seeded_outputs_of_no_speculation(model, workload):  # noqa: F811
    """With acceptance="sample_and_match" a draft model's drafts never change a seeded request's tokens: the
    outputs equal those without speculation (so they cannot depend on the batch, which trims drafts)."""
    reqs, _ = workload
    prompts = [r["prompt"] for r in reqs[:8]]
    params = [
        SamplingParams(max_tokens=16, temperature=0.3, top_k=3, seed=i, ignore_eos=True) for i in range(len(prompts))
    ]
    base = [o.outputs[0].token_ids for o in LLM(model, **OPTS).generate(prompts, params)]
    spec = draft_spec(noisy_copy(model, 0.05, seed=3), acceptance="sample_and_match")  # a draft near the target
    llm = LLM(model, speculative_config=spec, **OPTS)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == base
    assert llm.engine.scheduler.speculator.num_accepted_tokens > 0


def test_packaged_draft_for_the_packaged_model(tmp_path):
    """tinypy-draft for tinypy by name: the same greedy outputs as without it, drafts accepted."""
    prompts = ["import os\nimport sys\n\n\ndef main():\n", "class Stack:\n    def __init__(self):\n"]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    opts = dict(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=256, num_pages=64)  # one bucket: few compiles
    base = [o.outputs[0].token_ids for o in LLM("tinypy", warmup="none", **opts).generate(prompts, params)]
    llm = LLM("tinypy", speculative_config=draft_spec("tinypy-draft", 4), warmup="none", **opts)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == base
    assert llm.engine.scheduler.speculator.num_accepted_tokens > 0


def _checkpoint_copy(tmp_path, name, edit_config=None, edit_tokenizer=None):
    path = tmp_path / name
    shutil.copytree(packaged_model_path("tinypy-draft"), path)
    for file, edit in (("config.json", edit_config), ("tokenizer.json", edit_tokenizer)):
        if edit is not None:
            data = json.loads((path / file).read_text())
            edit(data)
            (path / file).write_text(json.dumps(data))
    return os.fspath(path)


def _swap_two_tokens(tok):
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]


@pytest.mark.parametrize(
    "draft, message",
    [
        (lambda tmp: "llama-tiny", "vocabulary"),
        (lambda tmp: _checkpoint_copy(tmp, "other_tok", edit_tokenizer=_swap_two_tokens), "tokenizer differs"),
        (
            lambda tmp: _checkpoint_copy(tmp, "short", edit_config=lambda c: c.update(max_position_embeddings=64)),
            "max_position_embeddings",
        ),
        (lambda tmp: "no-such-model", "draft_model"),
        (lambda tmp: None, "needs draft_model"),
        (lambda tmp: 3, "model name or path"),
    ],
    ids=["vocab", "tokenizer", "positions", "unknown", "missing", "not_a_model"],
)
def test_bad_draft_models_are_refused_before_anything_is_built(tmp_path, draft, message, monkeypatch):
    import cbjax.engine_build

    def no_loading(*a, **k):
        raise AssertionError("a model was loaded before the draft was checked")

    monkeypatch.setattr(cbjax.engine_build, "load_hf_model", no_loading)
    with pytest.raises(ValueError, match=message):
        LLMEngine("tinypy", speculative_config=draft_spec(draft(tmp_path)), max_model_len=256)


def test_a_draft_model_with_tensor_parallelism_is_refused():
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLMEngine(get_model_config("test-tiny"), speculative_config=draft_spec("test-tiny"), tensor_parallel_size=2)


def test_a_random_named_draft_is_not_the_targets_weights():
    from cbjax.runner.speculation.draft_model import load_draft_model

    draft = load_draft_model("test-tiny", None, None)
    target = init_model(get_model_config("test-tiny"), seed=0)
    assert not np.allclose(np.asarray(draft.embed.embedding[...]), np.asarray(target.embed.embedding[...]))
