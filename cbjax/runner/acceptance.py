"""Acceptance rules for speculative verification: which drafts pass, and the token sampled at each verify row.

A rule is a small frozen dataclass (hashable: it is a static argument of the jitted step) with one method:

  rule(logits [R, V], drafts [R] (-1: none), temperature, top_k, top_p [R], seeds [R], counters [R])
      -> (tokens [R] int32: the row's sample, accepted [R] bool: the row's draft passes)

The step keeps a sequence's leading accepted drafts, then the token sampled at its first rejected row (or at its
last row, the bonus token, when every draft passed). A rule defined outside cbjax/runner needs a repr that changes
with its code: the on-disk program cache (program_cache.py) hashes this package's source, not the caller's.
"""

import dataclasses

import jax.numpy as jnp

from cbjax.runner.sampler import sample


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

    def __call__(self, logits, drafts, temperature, top_k, top_p, seeds, counters):
        tokens = sample(logits, temperature, top_k, top_p, seeds, counters)
        return tokens, (tokens == drafts) & (drafts >= 0)


def first_rejection(accepted, num_drafts):
    """accepted [S, K+1] bool per slot and draft position; num_drafts [S] -> accepted drafts per slot [S]: the
    length of each slot's leading run of passed drafts."""
    j = jnp.arange(accepted.shape[1])[None, :]
    passed = accepted & (j < num_drafts[:, None])
    return jnp.sum(jnp.cumprod(passed.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)
