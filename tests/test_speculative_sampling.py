"""Sampled outputs keep their distribution under speculation: a statistical test on the engine that passes with
the right acceptance rules and fails with a wrong one (so it can fail).

One prompt, 1500 seeds, temperature 2 and top-k 3 (27 possible 3-token outputs). Each request samples t1 at its
prefill; its first decode verifies one draft (the second most likely token after t1: accepted about a third of the
time) and samples t3 as the bonus token when the draft passes. The outputs' empirical joint distribution is
compared with the exact one, computed from the model's own probabilities, by a chi-square test.
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
from cbjax.runner.acceptance import SampleAndMatch
from cbjax.runner.sampler import _filter_top_k_top_p, sample

TEMPERATURE, TOP_K, N = 2.0, 3, 1500
PROMPT = [5, 17, 99, 3, 250, 41, 7, 300]
OPTS = dict(max_num_seqs=32, max_num_batched_tokens=64, page_size=16, max_model_len=64, num_pages=64)
# Chi-square, 26 degrees of freedom at most: 54.1 is its 0.999 quantile. The seeds are fixed, so the test is
# deterministic: it passes or fails the same way every run.
CHI2_LIMIT = 54.1


def _probs(logits):
    x = logits / TEMPERATURE
    x = _filter_top_k_top_p(x, jnp.full((x.shape[0],), TOP_K), jnp.ones((x.shape[0],)))
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


def chi_square(model, exact, drafts, rule, speculate=True):
    spec = {"method": "ngram", "num_speculative_tokens": 1} if speculate else None
    engine = LLMEngine(model, speculative_config=spec, warmup="none", **OPTS)
    if speculate:
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
