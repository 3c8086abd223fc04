"""Output tokens -> text deltas, with OpenAI's `stop` strings.

The engine stops on token ids only, so stop strings are the server's: the text ends just before the first
occurrence of any of them (finish_reason "stop") and the server aborts the engine request. While streaming, the
last `len(longest stop) - 1` characters are held back until they can no longer begin a stop string, so no client
ever receives text that a later token turns into (part of) a stop string.
"""

from cbjax.model.tokenizer import IncrementalDetokenizer, Tokenizer


class TextStream:
    """One request's output text. `add(new_ids)` returns the text that may be sent now; `stopped` turns True when a
    stop string appeared (the text is then final); `finish()` returns whatever was held back."""

    def __init__(self, tokenizer: Tokenizer | None, prompt_ids, stop: tuple[str, ...] = ()):
        self._detok = IncrementalDetokenizer(tokenizer, prompt_ids) if tokenizer is not None else None
        self.stop = tuple(stop)
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""  # all text decoded so far (cut at a stop string once one is found)
        self.token_ids: list[int] = []
        self._sent = 0  # characters of `text` already returned
        self._searched = 0  # `text[:_searched]` holds no stop string
        self.stopped = False

    def add(self, new_ids) -> str:
        if self.stopped:
            return ""
        self.token_ids.extend(new_ids)
        if self._detok is not None:
            self.text += self._detok.add(new_ids)
        if self._find_stop():
            return self._emit(len(self.text))
        return self._emit(len(self.text) - self._hold)

    def finish(self) -> str:
        """The rest of the text, at the end of the request (an incomplete character, the held-back tail)."""
        if not self.stopped and self._detok is not None:
            self.text += self._detok.flush()
            self._find_stop()
        return self._emit(len(self.text))

    def _find_stop(self) -> bool:
        if not self.stop:
            return False
        start = max(0, self._searched - self._hold)
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True
            return True
        self._searched = len(self.text)
        return False

    def _emit(self, upto: int) -> str:
        upto = max(upto, self._sent)
        delta = self.text[self._sent : upto]
        self._sent = upto
        return delta
