"""GrammarConstraint: one request's structured-output state, an llguidance matcher behind the TokenConstraint
protocol (cbjax/core/structured_outputs.py).

The matcher's mask has one bit per id of the model's vocabulary: the compiler sizes the llguidance tokenizer to
it, so ids past the tokenizer's own (padding rows of the embedding) have no bytes and are never allowed. The mask
allows an end-of-sequence id exactly when the grammar may end there, and only those once the grammar is complete.
"""

import llguidance
import numpy as np


class GrammarConstraint:
    """Which tokens may come next under one compiled grammar, advanced by each accepted token.

    Built by GrammarCompiler.constraint (a fresh copy of a cached compiled matcher). `accept` refuses a token
    the grammar does not allow with a ValueError and leaves the state as it was. End-of-sequence ids that arrive
    after the grammar is complete (a request with ignore_eos keeps sampling them, the only tokens allowed) are
    counted here, not fed to the matcher, which takes nothing once stopped; `rollback` takes them back first."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, eos_token_ids: frozenset[int]):
        self._matcher = matcher
        self.vocab_size = vocab_size
        self.num_words = -(-vocab_size // 32)
        self._eos = eos_token_ids
        self._num_consumed = 0  # tokens the matcher took (it can roll back exactly these)
        self._num_eos_after_end = 0

    def fill_bitmask(self, row: np.ndarray) -> None:
        """Write the allowed next tokens into row (int32 [ceil(V / 32)], C-contiguous: bit i % 32 of word
        i // 32 set = token i allowed)."""
        if row.dtype != np.int32 or row.shape != (self.num_words,) or not row.flags.c_contiguous:
            raise ValueError(
                f"bitmask row must be a C-contiguous int32 array of shape ({self.num_words},), "
                f"got {row.dtype} {row.shape}"
            )
        # llguidance writes the words straight into the row's memory (no copy), with the GIL released.
        self._matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)

    def accept(self, tokens) -> None:
        """Advance over tokens; a token the grammar does not allow here is a ValueError (nothing is advanced)."""
        for taken, token in enumerate(map(int, tokens)):
            if not 0 <= token < self.vocab_size:
                problem = f"token id {token} is outside the vocabulary (size {self.vocab_size})"
            elif self._matcher.is_stopped():
                problem = None if token in self._eos else f"token {token} after the grammar is complete"
                self._num_eos_after_end += problem is None
            elif self._matcher.try_consume_tokens([token]) == 1:
                problem = None
                self._num_consumed += 1
            else:
                problem = f"token {token} is not allowed by the grammar here"
            if problem is not None:
                self.rollback(taken)
                raise ValueError(f"structured output: {problem}")

    def rollback(self, num_tokens: int) -> None:
        """Take back the last num_tokens accepted tokens (a speculative step's rejected drafts)."""
        if not 0 <= num_tokens <= self.num_accepted:
            raise ValueError(f"rollback of {num_tokens} tokens, but {self.num_accepted} were accepted")
        from_end = min(num_tokens, self._num_eos_after_end)
        self._num_eos_after_end -= from_end
        rest = num_tokens - from_end
        if rest:
            self._matcher.rollback(rest)
            self._num_consumed -= rest

    def is_finished(self) -> bool:
        """The grammar is complete: nothing but an end-of-sequence id may follow."""
        return self._matcher.is_stopped()

    def may_end(self) -> bool:
        """The output so far is a complete match (the grammar allows ending here, perhaps also going on)."""
        return self._matcher.is_accepting()

    @property
    def num_accepted(self) -> int:
        return self._num_consumed + self._num_eos_after_end
