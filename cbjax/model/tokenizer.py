"""Tokenizers: a Hugging Face `tokenizer.json` read with the `tokenizers` library, and incremental detokenization.

The tokenizer.json's own post-processor decides special tokens (e.g. a BOS in front of every prompt), so text
prompts encode exactly as transformers' fast tokenizer would encode them.
"""

import os

from tokenizers import Tokenizer as _HFTokenizer


class Tokenizer:
    """Text <-> token ids for one model."""

    def __init__(self, tok: _HFTokenizer, source: str = "<memory>"):
        self._tok = tok
        self.source = source

    @classmethod
    def from_file(cls, path: str) -> "Tokenizer":
        try:
            return cls(_HFTokenizer.from_file(path), path)
        except Exception as e:  # tokenizers raises a bare Exception for a malformed file
            raise ValueError(f"{path}: not a readable tokenizer.json ({e})") from None

    @classmethod
    def from_dir(cls, path: str) -> "Tokenizer | None":
        """The tokenizer.json of a checkpoint directory, or None when it has none (token-id prompts only)."""
        file = os.path.join(path, "tokenizer.json")
        return cls.from_file(file) if os.path.isfile(file) else None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def vocab(self) -> dict[str, int]:
        """Every token's id, added tokens included."""
        return self._tok.get_vocab(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def save(self, path: str) -> None:
        self._tok.save(path)


class IncrementalDetokenizer:
    """Turns a growing list of output ids into text deltas, one call per step.

    Decoding each new token on its own is wrong for byte-level BPE (a UTF-8 character can span tokens) and for
    SentencePiece (a token's leading space depends on the token before it). So, as vLLM does, each call decodes a
    short window of preceding tokens with and without the new ones and emits the difference, holding text back while
    it ends in an incomplete character (U+FFFD).
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids=(), skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.ids = list(prompt_ids)
        # A few prompt tokens of context, so the first output token decodes as it would inside the full text.
        self.prefix_offset = max(len(self.ids) - 5, 0)
        self.read_offset = len(self.ids)
        self.text = ""

    def add(self, new_ids) -> str:
        """Append `new_ids`; returns the text they completed (may be "" while a character is incomplete)."""
        self.ids.extend(int(t) for t in new_ids)
        dec = self.tokenizer.decode
        prefix = dec(self.ids[self.prefix_offset : self.read_offset], self.skip)
        full = dec(self.ids[self.prefix_offset :], self.skip)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        delta = full[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """Whatever text is still held back (an incomplete character at the very end), e.g. when the stream ends."""
        dec = self.tokenizer.decode
        prefix = dec(self.ids[self.prefix_offset : self.read_offset], self.skip)
        full = dec(self.ids[self.prefix_offset :], self.skip)
        delta = full[len(prefix) :] if len(full) > len(prefix) else ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += delta
        return delta
