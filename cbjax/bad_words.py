"""SamplingParams.bad_words -> the token sequences the sampler must never complete (vLLM's rule).

A word can appear at the start of the text or after a space, and a tokenizer spells the two differently (a leading
space is usually part of the token). So each word, its leading whitespace removed, is encoded as is and with one
leading space, without special tokens (as a continuation of the prompt); the spaced form is kept only when it is a
different word token of the same length (vLLM: sampling_params.update_from_tokenizer).
"""

from cbjax.model.tokenizer import Tokenizer


def bad_word_token_ids(words: tuple[str, ...], tokenizer: Tokenizer | None, vocab_size: int) -> tuple:
    """The token-id tuples of `words`. ValueError without a tokenizer, for a word of only whitespace, or for a word
    whose tokens fall outside the model's vocabulary."""
    if not words:
        return ()
    if tokenizer is None:
        raise ValueError("bad_words need a tokenizer; this model has none")
    out: list[tuple[int, ...]] = []
    for word in words:
        bare = word.lstrip()
        if not bare:
            raise ValueError(f"bad_words: {word!r} has nothing but whitespace")
        plain = tuple(tokenizer.encode(bare, add_special_tokens=False))
        spaced = tuple(tokenizer.encode(" " + bare, add_special_tokens=False))
        out.append(plain)
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    outside = sorted({t for ids in out for t in ids if not 0 <= t < vocab_size})
    if outside:
        raise ValueError(f"bad_words: token ids {outside} are outside the vocabulary of {vocab_size}")
    return tuple(out)
