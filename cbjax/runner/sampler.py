"""On-device sampling with per-slot parameters (arrays, so a new temperature never recompiles).

Greedy, temperature, top-k and top-p. Each slot's randomness comes from (request seed, index of the token being
sampled) alone, so the same seed and prompt give the same tokens whatever else shares the batch.
"""

import jax
import jax.numpy as jnp


def argmax_last(x, block: int = 128):
    """argmax over the last axis of x [B, V], first index on ties.

    XLA:CPU's argmax reduction carries (value, index) pairs and does not vectorise: over a 32k vocabulary it cost
    more than the LM-head matmul. Two plain max reductions (over blocks, then inside the winning block) give the
    same answer ~10x faster.
    """
    B, V = x.shape
    pad = (-V) % block
    if pad:
        x = jnp.pad(x, ((0, 0), (0, pad)), constant_values=-jnp.inf)
    xb = x.reshape(B, -1, block)
    best_block = jnp.argmax(jnp.max(xb, axis=-1), axis=-1)
    inside = jnp.take_along_axis(xb, best_block[:, None, None], axis=1)[:, 0]
    return (best_block * block + jnp.argmax(inside, axis=-1)).astype(jnp.int32)


def filter_top_k_top_p(x, top_k, top_p):
    """x [B, V] scaled logits -> x with everything outside each row's top-k and top-p nucleus set to -inf."""
    V = x.shape[-1]
    sorted_desc = -jnp.sort(-x, axis=-1)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, V), V)
    kth = jnp.take_along_axis(sorted_desc, (k - 1)[:, None], axis=-1)
    in_top_k = jnp.arange(V)[None, :] < k[:, None]
    probs = jax.nn.softmax(jnp.where(in_top_k, sorted_desc, -jnp.inf), axis=-1)
    # Keep the smallest prefix whose mass reaches top_p: token i stays if the mass before it is still < top_p.
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep = (mass_before < top_p[:, None]) & in_top_k
    num_keep = jnp.maximum(jnp.sum(keep, axis=-1), 1)
    cutoff = jnp.take_along_axis(sorted_desc, (num_keep - 1)[:, None], axis=-1)
    threshold = jnp.maximum(kth, cutoff)
    return jnp.where(x < threshold, -jnp.inf, x)


def sampling_logits(logits, temperature, top_k, top_p):
    """logits [B, V] -> the logits a sampled row draws from: divided by its temperature (1 where greedy), -inf
    outside its top-k and top-p nucleus. softmax of it is the row's sampling distribution."""
    t = jnp.where(temperature > 0, temperature, 1.0)
    x = logits / t[:, None]
    needs_filter = jnp.any((top_k > 0) | (top_p < 1.0))
    return jax.lax.cond(needs_filter, lambda: filter_top_k_top_p(x, top_k, top_p), lambda: x)


def row_keys(seeds, counters, stream: int = 0):
    """One PRNG key per row from (request seed, output index) alone; `stream` > 0 gives independent keys for the
    same token (speculative decoding's draft sample and acceptance draw, cbjax/runner/speculation/acceptance.py)."""
    keys = jax.vmap(lambda s, c: jax.random.fold_in(jax.random.key(s), c))(seeds, counters)
    return keys if stream == 0 else jax.vmap(lambda k: jax.random.fold_in(k, stream))(keys)


def gumbel_argmax(x, keys):
    """A sample of softmax(x) per row (x [B, V], -inf: excluded) by the Gumbel-max trick."""
    gumbel = jax.vmap(lambda k: jax.random.gumbel(k, (x.shape[-1],), jnp.float32))(keys)
    return argmax_last(x + gumbel)


def sample(logits, temperature, top_k, top_p, seeds, counters):
    """logits [B, V] float32; temperature, top_p [B] f32; top_k [B] i32 (<= 0: off); seeds [B] u32;
    counters [B] i32 (how many tokens the request has generated) -> tokens [B] int32."""
    greedy = argmax_last(logits)

    def stochastic():
        x = sampling_logits(logits, temperature, top_k, top_p)
        return gumbel_argmax(x, row_keys(seeds, counters))

    sampled = jax.lax.cond(jnp.all(temperature == 0), lambda: greedy, stochastic)
    return jnp.where(temperature == 0, greedy, sampled)
