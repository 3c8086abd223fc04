"""N-gram prompt lookup: draft tokens copied from the sequence's own context (prompt and outputs so far).

The longest suffix n-gram (prompt_lookup_max down to prompt_lookup_min tokens) that occurred earlier in the context
proposes the tokens that followed its most recent earlier occurrence. Code and structured text repeat themselves
(identifiers, argument lists, closing brackets), which is where this pays; it costs no model and no device time.
"""

import numpy as np


class NgramProposer:
    """`propose(context, k)`: up to k draft tokens for a context of token ids (a list or an int array)."""

    def __init__(self, min_n: int, max_n: int):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n

    def propose(self, context, k: int) -> list[int]:
        """One numpy pass over the context: the positions whose token equals the last one, then filtered by the
        tokens before (one comparison per n-gram length on the survivors only), so a long prompt costs about one
        vectorised comparison over its length."""
        ctx = np.asarray(context)
        L = ctx.shape[0]
        if k <= 0 or self.min_n >= L:
            return []
        # Ends j of earlier occurrences of the suffix: j < L - 1 so that a continuation exists.
        ends = np.flatnonzero(ctx[: L - 1] == ctx[L - 1])
        best = None  # the ends matching the longest n-gram so far (n >= min_n)
        n = 1
        while ends.size and n <= self.max_n:
            if n >= self.min_n:
                best = ends
            if n == self.max_n or n >= L - 1:
                break
            ends = ends[ends >= n]  # room for one more token before the match
            ends = ends[ctx[ends - n] == ctx[L - 1 - n]]
            n += 1
        if best is None:
            return []
        # The most recent occurrence with k tokens after it (code repeats what it just wrote); else the earliest,
        # whose continuation is the longest there is.
        full = best[best + k < L]
        start = int(full[-1] if full.size else best[0]) + 1
        return ctx[start : start + k].tolist()
