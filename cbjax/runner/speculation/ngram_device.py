"""N-gram prompt lookup on the device: the host proposer's rule (cbjax/core/speculation/ngram.py), jnp over a padded
per-slot token history, so that a program can propose drafts between its own steps without the host.

Speculation inside decode blocks (issue 37; speculative_block.py calls it between its iterations): a block that
verifies drafts on the device has to propose the next drafts from tokens only the device knows yet. The rule is the
host's, token for token (a test compares the two on random contexts): the longest suffix
n-gram (prompt_lookup_max down to min tokens, at most the context length - 1) that occurred earlier proposes the
tokens after its most recent earlier occurrence that has k tokens after it, else after its earliest one; fewer
than k where the context ends first.

Shapes: S slots, L the padded history length (a static bucket), K the most drafts (static). Cost O(S L max_n)
comparisons, nothing next to a forward pass.
"""

import jax
import jax.numpy as jnp


def propose_ngram(history, lengths, num_drafts, min_n: int, max_n: int, max_drafts: int):
    """history [S, L] int32 (slot s's context in history[s, :lengths[s]], anything after), lengths [S] int32,
    num_drafts [S] int32 (k per slot, <= max_drafts; 0: none) -> (drafts [S, max_drafts] int32 (-1 past each
    slot's count), counts [S] int32)."""
    if not 1 <= min_n <= max_n:
        raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {min_n}, {max_n}")
    return jax.vmap(lambda h, n, k: _propose_one(h, n, k, min_n, max_n, max_drafts))(history, lengths, num_drafts)


def _propose_one(ctx, n, k, min_n: int, max_n: int, max_drafts: int):
    L = ctx.shape[0]
    j = jnp.arange(L)
    match = j <= n - 2  # ends of earlier occurrences: a continuation follows them
    best_m = jnp.int32(0)  # the longest matched length (>= min_n), 0: none
    best = jnp.zeros(L, bool)
    for m in range(1, max_n + 1):  # (static: max_n is a few)
        back = j - (m - 1)  # the occurrence's m-th token from its end
        suffix = ctx[jnp.maximum(n - m, 0)]  # the context's m-th token from its end
        match = match & (back >= 0) & (ctx[jnp.maximum(back, 0)] == suffix)
        if m >= min_n:
            usable = (m <= n - 1) & jnp.any(match)  # (the host stops at m = n - 1)
            best_m = jnp.where(usable, m, best_m)
            best = jnp.where(usable, match, best)
    found = (best_m > 0) & (k > 0) & (n > min_n)
    full = best & (j + k < n)
    last_full = jnp.max(jnp.where(full, j, -1))
    first = jnp.argmax(best)  # (the first True)
    start = jnp.where(last_full >= 0, last_full, first) + 1
    count = jnp.where(found, jnp.clip(jnp.minimum(k, n - start), 0, max_drafts), 0).astype(jnp.int32)
    i = jnp.arange(max_drafts)
    drafts = jnp.where(i < count, ctx[jnp.minimum(start + i, L - 1)], -1).astype(jnp.int32)
    return drafts, count
