"""n > 1 on the real engine (core/sequence_group.py): the samples share the prompt's pages, copy the shared partly
filled page on write, and each greedy sample equals the full-forward reference, across policies, preemption by
recompute and by swap, chunked prefill and the prefix cache; nothing compiles after warmup, nothing leaks. Sampled
samples follow the model's distribution (a chi-square test on the first token, seeded so it cannot flake). The
scheduler's side over random cases without a model: tests/core/test_sequence_groups.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cbjax import LLM, LLMEngine, SamplingParams
from cbjax.model import get_model_config, init_model
from tests.helpers import greedy_reference

MAX_MODEL_LEN = 176
# All engines share these shapes, so the step programs compile once for the whole module.
OPTS = dict(
    max_num_seqs=6,
    max_num_batched_tokens=64,
    page_size=16,
    max_model_len=MAX_MODEL_LEN,
    num_pages=14,
    watermark_fraction=0.0,
)


@pytest.fixture(scope="module")
def model():
    return init_model(get_model_config("test-tiny"), seed=0)


@pytest.fixture(scope="module")
def workload(model):
    """Prompts whose fork lands mid-page (partly filled shared page: copy-on-write), on a page boundary (no copy),
    a one-token prompt (nothing shared), prompts longer than a step (chunked prefill), two with a shared prefix
    (prefix-cache hits); n from 1 to 4."""
    rng = np.random.default_rng(3)
    V = model.cfg.vocab_size
    prefix = rng.integers(3, V, 32).tolist()
    lengths = [21, 17, 1, 90, 40, 33, 70]
    prompts = [rng.integers(3, V, n).tolist() for n in lengths]
    prompts[4], prompts[5] = prefix + prompts[4][:8], prefix + prompts[5][:1]  # 40 and 33 tokens, 2 shared pages
    ns = [3, 2, 2, 4, 2, 3, 1]
    max_tokens = [int(m) for m in rng.integers(16, 60, len(prompts))]
    ref = greedy_reference(model, prompts, max_tokens, width=MAX_MODEL_LEN)
    return prompts, ns, max_tokens, ref


def run(engine, prompts, ns, max_tokens, temperature=0.0, seed=None):
    """Outputs by request index (staggered: a step after every 3 requests); request i's seed is seed + i."""
    got = {}
    for i, (p, n, m) in enumerate(zip(prompts, ns, max_tokens)):
        s = None if seed is None else seed + i
        params = SamplingParams(n=n, max_tokens=m, temperature=temperature, ignore_eos=True, seed=s)
        engine.add_request(str(i), p, params)
        if i % 3 == 2:
            got |= {int(o.request_id): o for o in engine.step() if o.finished}
    while engine.has_unfinished_requests():
        got |= {int(o.request_id): o for o in engine.step() if o.finished}
    return got


@pytest.mark.parametrize(
    "policy,mode,caching",
    [
        ("fcfs", "recompute", False),
        ("fcfs", "swap", True),
        ("sarathi", "recompute", True),
        ("sarathi", "swap", False),
        ("priority", "recompute", True),
        ("mlfq", "swap", True),
        ("static", "recompute", False),
    ],
)
def test_every_greedy_sample_equals_the_reference(model, workload, policy, mode, caching):
    prompts, ns, max_tokens, ref = workload
    engine = LLMEngine(
        model,
        policy=policy,
        preemption_mode=mode,
        num_host_pages=64 if mode == "swap" else None,
        enable_prefix_caching=caching,
        **OPTS,
    )
    engine.wait_until_warm()
    compiles = engine.num_compiles
    got = run(engine, prompts, ns, max_tokens)
    for i, n in enumerate(ns):
        outs = got[i].outputs
        assert [c.index for c in outs] == list(range(n))
        bad = [c.index for c in outs if c.token_ids != ref[i]]
        assert not bad, f"{policy}/{mode}: request {i}, samples {bad} differ from the reference"
    assert engine.num_compiles == compiles, "compiled after warmup"
    sched = engine.scheduler
    assert sched.pool.num_free == sched.pool.num_pages, "page leak"
    sched.pool.check_consistent()
    assert not sched.running and not sched.forking
    # Request 0 (21 tokens, 3 samples) forks at 20, mid-page: at least its 2 copies (a preempted sample returns
    # with pages of its own and copies nothing).
    assert engine.runner.page_copier.num_copied >= 2
    if policy != "static":  # (a static batch never preempts)
        assert sched.num_preemptions > 0, "the small pool was meant to force preemption"


def test_the_samples_share_the_prompt_pages(model):
    """One request of 4 samples and an 85-token prompt in 16-token pages (the fork at 84, in its 6th page): while
    its samples decode, the pool holds the prompt's 5 full pages once and a 6th page per sample (the shared partly
    filled one, copied by 3 of them)."""
    engine = LLMEngine(model, enable_prefix_caching=False, **OPTS)
    prompt = list(range(3, 88))
    engine.add_request("a", prompt, SamplingParams(n=4, max_tokens=5, temperature=0.0, ignore_eos=True))
    used = []
    while engine.has_unfinished_requests():
        engine.step()
        used.append(engine.scheduler.pool.num_used)
    assert max(used) == 5 + 4  # without sharing: 4 * 6
    assert engine.runner.page_copier.num_copied == 3


def test_sampled_first_tokens_follow_the_model_distribution(model):
    """240 samples (60 requests of n=4, seeded) of the first token at temperature 1: their counts over 6 bins
    of equal model probability pass a chi-square test against the full forward's softmax (5 degrees of freedom,
    p > 0.001); the samples of a request differ."""
    prompt = list(range(5, 25))
    logits = model.forward_full(jnp.asarray([prompt]))[0, -1]
    probs = np.asarray(jax.nn.softmax(logits.astype(jnp.float32)), np.float64)
    order = np.argsort(probs)
    cum = np.cumsum(probs[order])
    bins = 6
    bin_of = np.empty(len(probs), np.int64)
    bin_of[order] = np.minimum((cum * bins).astype(np.int64), bins - 1)  # tokens in order of probability
    expected = np.bincount(bin_of, weights=probs, minlength=bins)
    engine = LLMEngine(model, **OPTS)
    outs = run(engine, [prompt] * 60, [4] * 60, [1] * 60, temperature=1.0, seed=1234)
    firsts = [c.token_ids[0] for o in outs.values() for c in o.outputs]
    assert len(firsts) == 240
    counts = np.bincount(bin_of[firsts], minlength=bins)
    chi2 = float(((counts - 240 * expected) ** 2 / (240 * expected)).sum())
    assert chi2 < 20.52, (chi2, counts, 240 * expected)  # the 0.999 quantile of chi-square with 5 dof
    assert all(len({tuple(c.token_ids) for c in o.outputs}) > 1 for o in list(outs.values())[:10])
    # Reproducible: the same seed gives the same samples.
    again = run(LLMEngine(model, **OPTS), [prompt] * 2, [4] * 2, [1] * 2, temperature=1.0, seed=1234)
    assert [c.token_ids for c in again[0].outputs] == [c.token_ids for c in outs[0].outputs]


def test_the_llm_facade_and_the_simulator_return_n_completions(model, workload):
    prompts, ns, max_tokens, ref = workload
    llm = LLM(model, **OPTS)  # blocks of decode steps (num_scheduler_steps=8)
    params = [SamplingParams(n=n, max_tokens=m, temperature=0.0, ignore_eos=True) for n, m in zip(ns, max_tokens)]
    outs = llm.generate(prompts, params)
    assert [[c.token_ids for c in o.outputs] for o in outs] == [[r] * n for r, n in zip(ref, ns)]
    sim = LLMEngine("test-tiny", runner="sim", sim_accelerator="h200", **OPTS)
    got = run(sim, prompts, ns, max_tokens)
    assert [len(got[i].outputs) for i in range(len(ns))] == ns
    assert all(len(c.token_ids) == m for i, m in enumerate(max_tokens) for c in got[i].outputs)
    assert sim.runner.num_copied_pages >= 2 and sim.scheduler.pool.num_free == sim.scheduler.pool.num_pages


def test_best_of_returns_the_n_samples_of_highest_cumulative_logprob(model):
    """best_of=4, n=2 returns the 2 of the 4 samples (each sample's seed stream depends only on the request's seed
    and its index) whose cumulative logprob is highest, best first; n=4 with logprobs shows all 4."""
    prompt = list(range(7, 30))
    engine = LLMEngine(model, **OPTS)
    common = dict(max_tokens=6, temperature=1.0, seed=99, ignore_eos=True)
    engine.add_request("all", prompt, SamplingParams(n=4, logprobs=0, **common))
    engine.add_request("best", prompt, SamplingParams(n=2, best_of=4, **common))
    engine.add_request("plain", prompt, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    got = {}
    while engine.has_unfinished_requests():
        got |= {o.request_id: o for o in engine.step() if o.finished}
    every = sorted(got["all"].outputs, key=lambda c: -c.cumulative_logprob)
    assert len({tuple(c.token_ids) for c in every}) > 2, "the samples were meant to differ"
    best = got["best"].outputs
    assert [c.index for c in best] == [0, 1]
    assert [c.token_ids for c in best] == [c.token_ids for c in every[:2]]
    assert all(c.logprobs is None and c.cumulative_logprob is None for c in best)  # not asked for
    assert got["plain"].outputs[0].logprobs is None


@pytest.mark.parametrize(
    "params,options,match",
    [
        (dict(n=7), {}, "exceeds max_num_seqs=6"),
        (dict(n=2, best_of=3, temperature=0.0), {}, "best_of > n needs sampling"),
    ],
)
def test_bad_group_requests_are_refused(model, params, options, match):
    engine = LLMEngine(model, **(OPTS | options))
    with pytest.raises(ValueError, match=match):
        engine.add_request("x", [1, 2, 3], SamplingParams(**params))
    assert not engine.has_unfinished_requests()


def test_an_aborted_group_frees_every_sample(model):
    engine = LLMEngine(model, **OPTS)
    engine.add_request("g", list(range(3, 40)), SamplingParams(n=3, max_tokens=30, temperature=0.0))
    for _ in range(4):
        engine.step()
    engine.abort_request("g")
    outs = [o for o in engine.step() if o.request_id == "g"]
    while engine.has_unfinished_requests():
        engine.step()
    assert outs and outs[-1].finished and len(outs[-1].outputs) == 3
    assert all(c.finish_reason == "abort" for c in outs[-1].outputs)
    assert engine.scheduler.pool.num_free == engine.scheduler.pool.num_pages
    with pytest.raises(ValueError, match="unknown request id"):
        engine.abort_request("g")


def test_the_page_copier_copies_exactly_the_pairs_it_is_given():
    from cbjax.runner.page_copy import PageCopier

    rng = np.random.default_rng(0)
    # 2 layers of (k, v, k_scales, v_scales) [K=2, P+1=6, G=4, X]: an int8 cache's layout, pages 0-4 and the spare 5.
    shapes = [(2, 6, 4, 8), (2, 6, 4, 8), (2, 6, 4, 1), (2, 6, 4, 1)]
    caches = [tuple(jnp.asarray(rng.standard_normal(s), jnp.float32) for s in shapes) for _ in range(2)]
    before = [[np.asarray(a) for a in c] for c in caches]
    copier = PageCopier(pages_per_call=2, pad_page=5)
    caches = copier.warmup(caches)
    caches = copier(caches, [(1, 3), (4, 0), (2, 1)])  # two calls of 2 pairs; a destination read by a later call
    want = [[a.copy() for a in c] for c in before]
    for c in want:
        for a in c:
            a[:, 3], a[:, 0] = a[:, 1], a[:, 4]
            a[:, 1] = a[:, 2]
    for got_layer, want_layer in zip(caches, want):
        for got, w in zip(got_layer, want_layer):
            np.testing.assert_array_equal(np.asarray(got)[:, :5], w[:, :5])
    assert copier.num_copied == 3
