"""Sliding-window eviction: a tiny random Mistral checkpoint (window 32) whose pages outside the window are freed
stays token-exact with transformers over prompts and outputs longer than the window, with chunked prefill,
preemption by recompute and by swap, and the prefix cache; and no sequence ever holds more pages than the window
allows (checked after every schedule)."""

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the parity tests need torch (the project's test extra installs it)")
transformers = pytest.importorskip("transformers", reason="the parity tests need transformers (test extra)")

from cbjax import LLM, SamplingParams  # noqa: E402
from cbjax.core.scheduler import pages_for  # noqa: E402
from tests.model.hf_models import TINY, random_hf_model  # noqa: E402

WINDOW, PAGE = 32, 8
CONFIG = dict(max_position_embeddings=256, sliding_window=WINDOW)
# Prompts and outputs longer than the window; two prompts share a 48-token prefix (the prefix cache's case).
PROMPT_LENS = [70, 45, 90, 33, 60]
MAX_TOKENS = [50, 40, 20, 64, 45]
ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=32, page_size=PAGE, max_model_len=192, dtype="float32")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    model = random_hf_model("MistralConfig", "MistralForCausalLM", **CONFIG)
    path = str(tmp_path_factory.mktemp("mistral_window"))
    model.save_pretrained(path)
    return model, path


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(3)
    out = [rng.integers(3, TINY["vocab_size"], n).tolist() for n in PROMPT_LENS]
    out[4][:48] = out[2][:48]
    return out


@pytest.fixture(scope="module")
def want(checkpoint, prompts):
    model, _ = checkpoint
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    outs = []
    with torch.no_grad():
        for p, n in zip(prompts, MAX_TOKENS):
            ids = torch.tensor([p])
            gen = model.generate(ids, max_new_tokens=n, do_sample=False, attention_mask=torch.ones_like(ids))
            outs.append(gen[0, len(p) :].tolist())
    return outs


def run(path, prompts, **options):
    """The engine's greedy outputs, and the most pages any sequence held beyond the window's bound."""
    llm = LLM(path, **ENGINE, **options)
    sched = llm.engine.scheduler
    real_schedule, excess = sched.schedule, []

    def schedule_and_check():
        out = real_schedule()
        for seq in out.seqs:
            bound = pages_for(WINDOW + seq.num_new_tokens - 1, PAGE) + 1
            excess.append(len(seq.request.pages) - bound)
        sched.pool.check_consistent()
        return out

    sched.schedule = schedule_and_check
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in MAX_TOKENS]
    outs = llm.generate(prompts, params)
    assert sched.pool.num_free == sched.pool.num_pages  # every page back (cached ones are evictable)
    return [o.outputs[0].token_ids for o in outs], max(excess), sched


@pytest.mark.parametrize(
    "options",
    [
        dict(num_pages=64),
        dict(num_pages=16, preemption_mode="recompute"),  # 4 sequences need ~20: some are preempted
        dict(num_pages=16, preemption_mode="swap", num_host_pages=64),
        dict(num_pages=24, enable_prefix_caching=True),
        dict(num_pages=64, policy="sarathi", async_scheduling=False),
    ],
    ids=["roomy", "recompute", "swap", "prefix-cache", "sarathi-sync"],
)
def test_eviction_is_token_exact_and_bounds_the_pages_held(checkpoint, prompts, want, options):
    _, path = checkpoint
    got, excess, sched = run(path, prompts, **options)
    assert got == want
    assert excess <= 0, f"a sequence held {excess} page(s) more than window + chunk allow"
    if options["num_pages"] == 16:
        assert sched.num_preemptions > 0  # the pool really was too small for all of them at once


def test_without_eviction_sequences_hold_their_whole_context(checkpoint, prompts, want):
    _, path = checkpoint
    got, excess, _ = run(path, prompts, num_pages=96, evict_outside_window=False)
    assert got == want  # the window is a property of attention, not of eviction
    assert excess > 5  # long sequences kept pages the window never reads (the bound above can fail)


def test_a_request_longer_than_the_pool_fits_when_its_window_does(checkpoint):
    _, path = checkpoint
    llm = LLM(path, **{**ENGINE, "max_model_len": 256}, num_pages=12)
    sp = SamplingParams(max_tokens=150, temperature=0.0, ignore_eos=True)
    out = llm.generate([list(range(3, 83))], sp)[0]  # 230 tokens = 29 pages > 12, but a window holds ~10
    assert out.error is None and len(out.outputs[0].token_ids) == 150
