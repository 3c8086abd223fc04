"""Sampled outputs keep their distribution under speculation: a statistical test on the engine that passes with
the right acceptance rules and fails with a wrong one (so it can fail), for one-hot drafts (n-gram) and for a
draft model's sampled drafts (the general rejection rule).

One prompt, 1500 seeds, temperature 2 and top-k 3 (27 possible 3-token outputs). Each request samples t1 at its
prefill; its first decode verifies one draft (the second most likely token after t1: accepted about a third of the
time) and samples t3 as the bonus token when the draft passes. The outputs' empirical joint distribution is
compared with the exact one, computed from the model's own probabilities, by a chi-square test. With a draft
model (the target with noise on its weights, so q is near p but not p) the first decode's draft is the draft's own
sample of t2 from q, verified by min(1, p/q) with the residual max(p - q, 0) on rejection.
"""

import dataclasses
import hashlib
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cbjax import LLMEngine, SamplingParams
from cbjax.model import get_model_config, init_model
from cbjax.runner.sampler import filter_top_k_top_p, sample
from cbjax.runner.speculation.acceptance import RejectionSampling, SampleAndMatch
from tests.helpers import noisy_copy

TEMPERATURE, TOP_K, N = 2.0, 3, 1500
PROMPT = [5, 17, 99, 3, 250, 41, 7, 300]
OPTS = dict(max_num_seqs=32, max_num_batched_tokens=64, page_size=16, max_model_len=64, num_pages=64)
# Chi-square, 26 degrees of freedom at most: 54.1 is its 0.999 quantile. The seeds are fixed, so the test is
# deterministic: it passes or fails the same way every run.
CHI2_LIMIT = 54.1


def _probs(logits):
    x = logits / TEMPERATURE
    x = filter_top_k_top_p(x, jnp.full((x.shape[0],), TOP_K), jnp.ones((x.shape[0],)))
    return jax.nn.softmax(x, axis=-1)


class _RuleInTests:
    """The on-disk program cache keys a program by its description (the rule's repr included) and the source of
    cbjax's traced packages, not of tests: this repr changes with the rule's code, so an edit is never stale."""

    def __repr__(self):
        digest = hashlib.sha256(inspect.getsource(type(self)).encode()).hexdigest()[:16]
        return f"{type(self).__name__}@{digest}"


@dataclasses.dataclass(frozen=True, repr=False)
class TextbookRule(_RuleInTests):
    """The rule as papers write it for a one-hot q: accept x when u < p(x) (u uniform, its own key); on rejection
    draw from p without x. Right, but with other random numbers than SampleAndMatch."""

    def __call__(self, logits, drafts, temperature, top_k, top_p, seeds, counters):
        p = _probs(logits)
        keys = jax.vmap(lambda s, c: jax.random.fold_in(jax.random.fold_in(jax.random.key(s), c), 7))(seeds, counters)
        u = jax.vmap(lambda k: jax.random.uniform(k))(keys)
        accepted = (drafts >= 0) & (u < jnp.take_along_axis(p, jnp.maximum(drafts, 0)[:, None], 1)[:, 0])
        # p without x: the filtered (top-k) distribution with x removed, sampled as it is (no second filter).
        without = jnp.where(jnp.arange(p.shape[1])[None, :] == drafts[:, None], 0.0, p)
        ones, off = jnp.ones_like(temperature), jnp.zeros_like(top_k)
        return sample(jnp.log(without), ones, off, jnp.ones_like(top_p), seeds, counters), accepted


@dataclasses.dataclass(frozen=True, repr=False)
class ForgetsToRemoveTheDraft(_RuleInTests):
    """A classic bug: accept x when u < p(x), but on rejection draw from p itself (x again included)."""

    def __call__(self, logits, drafts, temperature, top_k, top_p, seeds, counters):
        p = _probs(logits)
        keys = jax.vmap(lambda s, c: jax.random.fold_in(jax.random.fold_in(jax.random.key(s), c), 7))(seeds, counters)
        u = jax.vmap(lambda k: jax.random.uniform(k))(keys)
        accepted = (drafts >= 0) & (u < jnp.take_along_axis(p, jnp.maximum(drafts, 0)[:, None], 1)[:, 0])
        return sample(logits, temperature, top_k, top_p, seeds, counters), accepted


@dataclasses.dataclass(frozen=True, repr=False)
class ResamplesFromP(_RuleInTests):
    """The general rule's classic bug: accept x with probability min(1, p(x)/q(x)), but on rejection draw from p
    instead of the residual max(p - q, 0). Right for a one-hot q far from p, wrong for a q near p."""

    uses_draft_probs = True

    def __call__(self, logits, drafts, temperature, top_k, top_p, seeds, counters, draft_probs):
        _, accepted = RejectionSampling()(logits, drafts, temperature, top_k, top_p, seeds, counters, draft_probs)
        return sample(logits, temperature, top_k, top_p, seeds, counters), accepted


class TableProposer:
    def __init__(self, table):
        self.table = table

    def propose(self, context, k):
        return self.table.get(tuple(context), [])[:k]


@pytest.fixture(scope="module")
def setup():
    model = init_model(get_model_config("test-tiny"), seed=0)
    fwd = jax.jit(model.forward_full)

    def next_probs(ctx):
        return np.asarray(_probs(fwd(jnp.asarray([ctx]))[0, -1:]))[0]

    exact, drafts = {}, {}
    p1 = next_probs(PROMPT)
    for t1 in np.flatnonzero(p1):
        p2 = next_probs([*PROMPT, t1])
        drafts[(*PROMPT, int(t1))] = [int(np.argsort(-p2)[1])]  # the second most likely: often rejected
        for t2 in np.flatnonzero(p2):
            p3 = next_probs([*PROMPT, t1, t2])
            for t3 in np.flatnonzero(p3):
                exact[int(t1), int(t2), int(t3)] = p1[t1] * p2[t2] * p3[t3]
    return model, exact, drafts


def chi_square(model, exact, drafts, rule, speculate=True, draft_model=None):
    spec = {"method": "ngram", "num_speculative_tokens": 1} if speculate else None
    if draft_model is not None:
        spec = {"method": "draft", "draft_model": draft_model, "num_speculative_tokens": 1}
    engine = LLMEngine(model, speculative_config=spec, warmup="none", **OPTS)
    if speculate:
        if draft_model is None:
            engine.scheduler.speculator.proposer = TableProposer(drafts)
        if rule is not None:  # a test seam: the step's acceptance rule (a static argument of its program)
            engine.runner.speculation = dataclasses.replace(engine.runner.speculation, rule=rule)
    for i in range(N):
        engine.add_request(str(i), PROMPT, SamplingParams(max_tokens=3, temperature=TEMPERATURE, top_k=TOP_K, seed=i))
    counts: dict = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                key = tuple(out.outputs[0].token_ids)
                counts[key] = counts.get(key, 0) + 1
    assert sum(counts.values()) == N and set(counts) <= set(exact)
    spec = engine.scheduler.speculator
    acceptance = spec.acceptance_rate if spec is not None else None
    # Cells expected under 5 times are pooled into one, as the chi-square approximation wants.
    small = [c for c in exact if exact[c] * N < 5]
    cells = [[c] for c in exact if c not in small] + ([small] if small else [])
    stat = 0.0
    for cell in cells:
        e = N * sum(exact[c] for c in cell)
        o = sum(counts.get(c, 0) for c in cell)
        stat += (o - e) ** 2 / e
    return stat, acceptance


def test_outputs_without_speculation_fit_the_exact_distribution(setup):
    model, exact, drafts = setup
    stat, _ = chi_square(model, exact, drafts, None, speculate=False)
    assert stat < CHI2_LIMIT


@pytest.mark.parametrize("rule", [SampleAndMatch(), TextbookRule()], ids=["sample_and_match", "textbook"])
def test_right_acceptance_rules_keep_the_distribution(setup, rule):
    model, exact, drafts = setup
    stat, acceptance = chi_square(model, exact, drafts, rule)
    assert 0.1 < acceptance < 0.7, "the drafts were meant to be accepted and rejected often"
    assert stat < CHI2_LIMIT


def test_a_wrong_acceptance_rule_fails_the_test(setup):
    model, exact, drafts = setup
    stat, acceptance = chi_square(model, exact, drafts, ForgetsToRemoveTheDraft())
    assert stat > CHI2_LIMIT, f"the wrong rule went unnoticed (chi-square {stat:.1f}, acceptance {acceptance:.2f})"


@pytest.fixture(scope="module")
def draft_model(setup):
    return noisy_copy(setup[0], 0.05, seed=2)


@pytest.mark.parametrize("rule", [None, SampleAndMatch()], ids=["rejection_sampling", "sample_and_match"])
def test_a_draft_models_drafts_keep_the_distribution(setup, draft_model, rule):
    """The engine's default rule for a draft model (RejectionSampling), and sample-and-match (also right: its
    output is always a sample of p, whatever q; it only accepts less often)."""
    model, exact, _ = setup
    stat, acceptance = chi_square(model, exact, None, rule, draft_model=draft_model)
    assert 0.2 < acceptance < 0.95, "the draft was meant to be near the target, not equal"
    assert stat < CHI2_LIMIT


def test_rejection_sampling_accepts_more_than_sample_and_match(setup, draft_model):
    model, exact, _ = setup
    _, general = chi_square(model, exact, None, None, draft_model=draft_model)
    _, matching = chi_square(model, exact, None, SampleAndMatch(), draft_model=draft_model)
    assert general > matching + 0.05


def test_a_wrong_rule_for_a_draft_model_fails_the_test(setup, draft_model):
    model, exact, _ = setup
    stat, acceptance = chi_square(model, exact, None, ResamplesFromP(), draft_model=draft_model)
    assert stat > CHI2_LIMIT, f"the wrong rule went unnoticed (chi-square {stat:.1f}, acceptance {acceptance:.2f})"
