"""Acceptance rules for speculative verification: which drafts pass, and the token sampled at each verify row.

A rule is a small frozen dataclass (hashable: it is a static argument of the jitted step) with one method:

  rule(logits [R, V], drafts [R] (-1: none), temperature, top_k, top_p [R], seeds [R], counters [R]
       [, draft_probs: () -> [R, V] when the rule's `uses_draft_probs` (absent: False)])
      -> (tokens [R] int32: the row's sample, accepted [R] bool: the row's draft passes)

The step keeps a sequence's leading accepted drafts, then the token sampled at its first rejected row (or at its
last row, the bonus token, when every draft passed). A rule defined outside cbjax/runner needs a repr that changes
with its code: the on-disk program cache (compilation/program_store.py) hashes this package's source, not the caller's.
"""

import dataclasses

import jax
import jax.numpy as jnp

from cbjax.runner.sampler import gumbel_argmax, row_keys, sample, sampling_logits

# PRNG streams of one output index besides the plain sample's (stream 0): a draft model's sample of that token, the
# uniform draw that accepts or rejects it, and the resample from the residual on rejection. Independent keys:
# the rejection rule needs the draft and the acceptance draw independent.
DRAFT_STREAM, ACCEPT_STREAM, RESIDUAL_STREAM = 1, 2, 3


@dataclasses.dataclass(frozen=True)
class SampleAndMatch:
    """Rejection sampling for a one-hot draft distribution (n-gram drafts: q(x) = 1 for the draft token x).

    The rule of Leviathan et al. / Chen et al. accepts x with probability min(1, p(x) / q(x)) = p(x) and, on
    rejection, draws from normalize(max(p - q, 0)) = p without x. Drawing y ~ p with the row's own key (the
    request's seed and the output index, exactly as a step without speculation would) and accepting iff y == x
    realises that rule: P(accept) = p(x), and given a rejection y is distributed as p without x. On top of the right
    distribution it gives the same tokens as no speculation for the same seed: a request's output does not depend
    on how many drafts it got, hence not on its batch (the adaptive rules change k with the batch size). Greedy
    (temperature 0) is the exact-match special case.
    """

    uses_draft_probs = False

    def __call__(self, logits, drafts, temperature, top_k, top_p, seeds, counters):
        tokens = sample(logits, temperature, top_k, top_p, seeds, counters)
        return tokens, (tokens == drafts) & (drafts >= 0)


@dataclasses.dataclass(frozen=True)
class RejectionSampling:
    """The rule of Leviathan et al. / Chen et al. for drafts sampled from a draft model's distribution q (rows'
    `draft_probs()`, after the request's temperature, top-k and top-p, as the draft sampled them): draft x passes
    with probability min(1, p(x) / q(x)); on rejection the row's token is drawn from normalize(max(p - q, 0)). The
    output is then distributed as p exactly, and a draft passes with probability sum_x min(p(x), q(x)) (sample-
    and-match's sum_x p(x) q(x) is never more). Greedy rows (temperature 0, p and q one-hot): pass iff the draft is
    the argmax, else the argmax. A row without a draft (the bonus row) samples p as a step without drafts would."""

    uses_draft_probs = True

    def __call__(self, logits, drafts, temperature, top_k, top_p, seeds, counters, draft_probs):
        plain = sample(logits, temperature, top_k, top_p, seeds, counters)
        has_draft = drafts >= 0

        def stochastic():
            x = sampling_logits(logits, temperature, top_k, top_p)
            p = jax.nn.softmax(x, axis=-1)
            d = jnp.maximum(drafts, 0)[:, None]
            p_x = jnp.take_along_axis(p, d, axis=-1)[:, 0]
            q = draft_probs()  # (computed here, inside the branch: an all-greedy step never builds it)
            q_x = jnp.take_along_axis(q, d, axis=-1)[:, 0]
            u = jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(row_keys(seeds, counters, ACCEPT_STREAM))
            accept = u * q_x < p_x  # u < min(1, p/q) without dividing (q_x > 0: the draft was drawn from q)
            residual = jnp.maximum(p - q, 0.0)
            # p == q leaves no residual (then a rejection has probability 0); fall back to p to stay defined.
            residual = jnp.where(jnp.sum(residual, axis=-1, keepdims=True) > 0, residual, p)
            resampled = gumbel_argmax(jnp.log(residual), row_keys(seeds, counters, RESIDUAL_STREAM))
            return accept, resampled

        greedy = jnp.all(temperature == 0)
        accept, resampled = jax.lax.cond(greedy, lambda: (jnp.zeros_like(has_draft), plain), stochastic)
        sampled_row = temperature > 0
        accepted = has_draft & jnp.where(sampled_row, accept, plain == drafts)
        tokens = jnp.where(has_draft & sampled_row, resampled, plain)
        return tokens.astype(jnp.int32), accepted


def make_rule(name: str):
    """The rule a speculative_config's `acceptance` names (cbjax/core/speculation/config.py)."""
    return {"rejection_sampling": RejectionSampling, "sample_and_match": SampleAndMatch}[name]()


def first_rejection(accepted, num_drafts):
    """accepted [S, K+1] bool per slot and draft position; num_drafts [S] -> accepted drafts per slot [S]: the
    length of each slot's leading run of passed drafts."""
    j = jnp.arange(accepted.shape[1])[None, :]
    passed = accepted & (j < num_drafts[:, None])
    return jnp.sum(jnp.cumprod(passed.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)
