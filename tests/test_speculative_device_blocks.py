"""Speculative blocks (speculative_config.device_blocks, cbjax/core/speculation/speculative_blocks.py): n-gram
propose, verify and accept iterated on the device inside one dispatch. On the real engine the outputs equal the
engine's without speculation token for token: greedy over a batch mix (one sequence alone, several of different
lengths, prompts that repeat themselves so drafts pass, max_tokens ending inside a block, stop tokens and EOS, an
abort mid-run, max_model_len reached), and seeded sampling (sample-and-match draws each row with the request's seed
and output index). Nothing compiles after warmup, no page leaks, and the speculator's tallies add up."""

import numpy as np
import pytest

from cbjax import LLM, LLMEngine, SamplingParams
from cbjax.core.speculation.config import SpeculativeConfig
from cbjax.engine_config import EngineConfig
from cbjax.model import get_model_config, init_model

K, N = 3, 4  # drafts per iteration, iterations (decode steps) per block
MAX_MODEL_LEN = 256
OPTS = dict(max_num_seqs=8, max_num_batched_tokens=64, page_size=16, max_model_len=MAX_MODEL_LEN, num_pages=96)
SPEC = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1, "device_blocks": True}


@pytest.fixture(scope="module")
def model():
    return init_model(get_model_config("test-tiny"), seed=0)


@pytest.fixture(scope="module")
def engines(model):
    """(the engine without speculation, the engine with speculative blocks), both with blocks of N decode steps,
    built once for the module (each test's runs start from idle engines)."""
    plain = LLMEngine(model, num_scheduler_steps=N, **OPTS)
    spec = LLMEngine(model, num_scheduler_steps=N, speculative_config=SPEC, **OPTS)
    for engine in (plain, spec):
        engine.wait_until_warm()
    return plain, spec


def repeating_prompts(n: int, seed: int, repeats: int = 4, length=(4, 12)) -> list[list[int]]:
    """Prompts that repeat a random phrase: the n-gram lookup finds drafts in them (and in the loops a random model
    falls into)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 512, int(rng.integers(*length))).tolist() * repeats for _ in range(n)]


class Run:
    """One generate on an engine: the outputs' tokens and finish reasons, and the engine's records of it."""

    def __init__(self, engine: LLMEngine, prompts, params):
        compiles, first, spec = engine.num_compiles, len(engine.step_records), engine.scheduler.speculator
        before = None if spec is None else (spec.num_draft_tokens, spec.num_accepted_tokens)
        outs = LLM.from_engine(engine).generate(prompts, params)
        assert engine.num_compiles == compiles, "compiled after warmup"
        pool = engine.scheduler.pool
        assert pool.num_free == pool.num_pages, "page leak"
        pool.check_consistent()
        self.tokens = [o.outputs[0].token_ids for o in outs]
        self.reasons = [o.outputs[0].finish_reason for o in outs]
        self.records = engine.step_records[first:]
        if spec is not None:
            self.drafted = spec.num_draft_tokens - before[0]
            self.accepted = spec.num_accepted_tokens - before[1]

    @property
    def speculative_blocks(self) -> list[dict]:
        """The steps that were speculative blocks: blocks whose speculator tallied drafts."""
        return [r for r in self.records if r["decode_steps"] > 1 and sum(r["spec_drafted_by_position"])]


def check_same(plain: Run, spec: Run) -> None:
    assert [i for i, (a, b) in enumerate(zip(spec.tokens, plain.tokens)) if a != b] == []
    assert spec.reasons == plain.reasons
    assert spec.speculative_blocks, "no speculative block ran"
    assert 0 < spec.accepted < spec.drafted, "drafts were meant to pass and fail"
    # The step records add up to the speculator's tallies (a block's drafts counted where the device proposed them).
    assert sum(r["spec_draft_tokens"] for r in spec.records) == spec.drafted
    assert sum(sum(r["spec_drafted_by_position"]) for r in spec.records) == spec.drafted
    assert sum(r["spec_accepted_tokens"] for r in spec.records) == spec.accepted


@pytest.fixture(scope="module")
def sync_engine(model):
    """The engine with speculative blocks and synchronous scheduling (each step received before the next)."""
    engine = LLMEngine(model, num_scheduler_steps=N, speculative_config=SPEC, async_scheduling=False, **OPTS)
    engine.wait_until_warm()
    return engine


@pytest.mark.parametrize("scheduling", ["async", "sync"])
def test_greedy_batch_mix_equals_no_speculation(engines, sync_engine, scheduling):
    """Sequences of different lengths and max_tokens (several end inside a block, one gets a single token),
    together; then one alone."""
    plain, spec = engines
    spec = spec if scheduling == "async" else sync_engine
    prompts = repeating_prompts(7, seed=3) + [list(range(3, 200))]  # (the last: no repeat, few drafts)
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in (24, 1, 17, 40, 9, 31, 5, 22)]
    want = Run(plain, prompts, params)
    got = Run(spec, prompts, params)
    check_same(want, got)
    assert max(r["num_scheduled_seqs"] for r in got.speculative_blocks) > 1
    # A speculative block gives a sequence up to N (K + 1) tokens: fewer dispatches than blocks of plain steps.
    assert len(got.records) < len(want.records)
    alone = [SamplingParams(max_tokens=45, temperature=0.0, ignore_eos=True)]
    check_same(Run(plain, prompts[3:4], alone), Run(spec, prompts[3:4], alone))


def test_stop_tokens_and_eos_inside_blocks_end_the_request_there(engines):
    plain, spec = engines
    prompts = repeating_prompts(6, seed=11)
    free = [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)] * len(prompts)
    full = Run(plain, prompts, free).tokens
    # Each request stops at its 13th output's value (its first occurrence, which may come earlier).
    params = [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop_token_ids=[t[12]]) for t in full]
    got = Run(spec, prompts, params)
    assert got.tokens == [t[: t.index(t[12]) + 1] for t in full]
    assert set(got.reasons) == {"stop"}
    check_same(Run(plain, prompts, params), got)
    # EOS: with ignore_eos off both engines end each request at the model's EOS token, where one comes.
    with_eos = [SamplingParams(max_tokens=40, temperature=0.0)] * len(prompts)
    want = Run(plain, prompts, with_eos)
    assert "stop" in want.reasons  # (request 3 meets the model's EOS, token 2, within 40 tokens)
    check_same(want, Run(spec, prompts, with_eos))


def test_max_model_len_reached_inside_a_block(engines):
    """Prompts plus max_tokens of exactly max_model_len (the most the engine admits): each sequence's last tokens
    fill its page table's last page, wherever that falls in a block."""
    plain, spec = engines
    rng = np.random.default_rng(5)
    prompts = [(rng.integers(3, 512, 10).tolist() * 30)[: MAX_MODEL_LEN - 30 + 3 * i] for i in range(5)]
    params = [SamplingParams(max_tokens=MAX_MODEL_LEN - len(p), temperature=0.0, ignore_eos=True) for p in prompts]
    want, got = Run(plain, prompts, params), Run(spec, prompts, params)
    check_same(want, got)
    assert [len(p) + len(t) for p, t in zip(prompts, got.tokens)] == [MAX_MODEL_LEN] * len(prompts)


def test_seeded_sampling_equals_no_speculation(engines):
    """Sample-and-match: row j of an iteration samples with the request's seed and output index, so the outputs are
    those of the engine without speculation, and drafts that match the sample pass."""
    plain, spec = engines
    prompts = repeating_prompts(6, seed=7)
    params = [
        SamplingParams(max_tokens=30 + 3 * i, temperature=0.7, top_k=8, seed=100 + i, ignore_eos=True)
        for i in range(len(prompts))
    ]
    check_same(Run(plain, prompts, params), Run(spec, prompts, params))


def test_an_abort_mid_run_leaves_the_others_exact(engines):
    plain, spec = engines
    prompts = repeating_prompts(5, seed=13)
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    want = Run(plain, prompts, params).tokens
    compiles, first = spec.num_compiles, len(spec.step_records)
    for i, p in enumerate(prompts):
        spec.add_request(str(i), p, params)
    final, steps = {}, 0
    while spec.has_unfinished_requests():
        for out in spec.step():
            if out.finished:
                final[out.request_id] = (out.outputs[0].token_ids, out.outputs[0].finish_reason)
        steps += 1
        if steps == 3:
            spec.abort_request("2")
    assert final["2"][1] == "abort" and final["2"][0] == want[2][: len(final["2"][0])]
    assert [final[str(i)][0] for i in (0, 1, 3, 4)] == [want[i] for i in (0, 1, 3, 4)]
    assert spec.num_compiles == compiles
    assert any(r["decode_steps"] > 1 and sum(r["spec_drafted_by_position"]) for r in spec.step_records[first:])
    pool = spec.scheduler.pool
    assert pool.num_free == pool.num_pages


def test_device_blocks_are_an_ngram_option_on_by_default_in_an_engine():
    assert SpeculativeConfig.from_option(SPEC).device_lookup == (1, 4)
    assert SpeculativeConfig.from_option({**SPEC, "device_blocks": False}).device_lookup is None
    # Left None, an engine's config turns them on for ngram, off for a draft model; a scheduler alone keeps None.
    assert SpeculativeConfig().device_blocks is None and SpeculativeConfig().device_lookup is None
    assert EngineConfig.from_options(speculative_config={"method": "ngram"}).speculative.device_blocks is True
    draft = {"method": "draft", "draft_model": "tinypy-draft"}
    assert EngineConfig.from_options(speculative_config=draft).speculative.device_blocks is False
    with pytest.raises(ValueError, match="device_blocks"):
        SpeculativeConfig.from_option({"method": "draft", "draft_model": "tinypy-draft", "device_blocks": True})
