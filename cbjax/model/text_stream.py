"""One output's text as its tokens arrive: incremental detokenization and stop strings (vLLM's semantics).

The engine (cbjax/stop_strings.py) feeds it a request's received tokens to find stop strings; the server
(cbjax/serve/app.py) feeds it a plain request's tokens to stream text. One implementation, so both agree.

- Tokens are detokenized with a few tokens of context (IncrementalDetokenizer), and text ending in an incomplete
  UTF-8 character is held back until the character is complete: a multi-byte character is never split.
- Stop strings are searched after each token (so the token that completes one is known), only once more than
  `min_tokens` tokens have arrived (vLLM). The text ends before the earliest occurrence, or after it with
  `include_stop_str_in_output`; the tokens after the one that completed it are not taken.
- A request that ends on a stop token id (or EOS) does not show that token's text, unless
  `include_stop_str_in_output` (vLLM).
- While streaming, the last `len(longest stop) - 1` characters are held back (unless `include_stop_str_in_output`),
  so a client never receives text that a later token turns into (part of) a stop string.
"""

from cbjax.model.tokenizer import IncrementalDetokenizer, Tokenizer


class TextStream:
    """One output's text. `add(ids)` takes tokens; `visible_text(finished)` is the text that may be shown now and
    `delta(finished)` what of it was not returned before; `stop_reason` is the stop string found, if any."""

    def __init__(
        self,
        tokenizer: Tokenizer | None,
        prompt_ids=(),
        stop: tuple[str, ...] = (),
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
    ):
        # Without a tokenizer (a token-id model) the text stays empty and no stop string is ever found.
        self._detok = IncrementalDetokenizer(tokenizer, prompt_ids) if tokenizer is not None else None
        self.stop = tuple(stop)
        self.include_stop = include_stop_str_in_output
        self.min_tokens = min_tokens
        longest = max((len(s) for s in self.stop), default=0)
        self._hold = longest - 1 if self.stop and not include_stop_str_in_output else 0
        self._overlap = max(longest - 1, 0)  # a stop may begin this far before the text searched last time
        self.text = ""  # all text decoded so far (cut at the stop string once one is found)
        self.num_tokens = 0  # tokens taken
        self.stop_reason: str | None = None
        self._searched = 0  # `text[:_searched]` holds no stop string
        self._sent = 0  # characters of `text` already returned by `delta`
        self._flushed = False

    @property
    def stopped(self) -> bool:
        return self.stop_reason is not None

    def add(self, new_ids, ends_with_stop_token: bool = False) -> int | None:
        """Take `new_ids` (the last one the stop token id that finished the request when `ends_with_stop_token`).
        Returns the index in `new_ids` of the token that completed a stop string (the ones after it are not taken),
        or None."""
        if self.stopped or not new_ids:
            return None
        shown = new_ids
        if ends_with_stop_token and not self.include_stop:
            shown = new_ids[:-1]
        if self._detok is None or not self.stop:
            self.num_tokens += len(new_ids)
            if self._detok is not None and shown:
                self.text += self._detok.add(shown)
            return None
        for k, token in enumerate(shown):
            self.num_tokens += 1
            self.text += self._detok.add((token,))
            if self.num_tokens <= self.min_tokens:
                self._searched = len(self.text)  # no stop before min_tokens (vLLM); one may end after it
            elif self._find_stop():
                return k
        self.num_tokens += len(new_ids) - len(shown)
        return None

    def finish(self) -> None:
        """The request ended: take the text still held back in the detokenizer (an incomplete character)."""
        if self.stopped or self._detok is None or self._flushed:
            return
        self._flushed = True
        self.text += self._detok.flush()
        if self.stop and self.num_tokens > self.min_tokens:
            self._find_stop()

    def visible_text(self, finished: bool) -> str:
        """The text that may be shown: all of it once finished or stopped, else without the held-back tail."""
        if finished or self.stopped or not self._hold:
            return self.text
        return self.text[: max(len(self.text) - self._hold, self._sent)]

    def delta(self, finished: bool) -> str:
        """The visible text not returned by an earlier call (a stream's next chunk)."""
        upto = len(self.visible_text(finished))
        out = self.text[self._sent : upto]
        self._sent = max(upto, self._sent)
        return out

    def _find_stop(self) -> bool:
        start = max(0, self._searched - self._overlap)
        best = None  # (index, stop string): the earliest occurrence wins (the first listed on a tie)
        for s in self.stop:
            i = self.text.find(s, start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            self._searched = len(self.text)
            return False
        i, s = best
        self.text = self.text[: i + len(s) if self.include_stop else i]
        self.stop_reason = s
        return True
