"""Tokenizer wrapper and incremental detokenization (byte-level BPE and SentencePiece-style metaspace)."""

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from cbjax.model.tokenizer import IncrementalDetokenizer, Tokenizer

TEXT = "naïve café — 東京 😀 def f(x):\n    return x ** 2\n"


@pytest.fixture(scope="module")
def byte_bpe():
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # A vocabulary this small keeps multi-byte characters split over several tokens.
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<eos>"],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(["def f(x):\n    return x\n"] * 20, trainer)
    return Tokenizer(tok)


def test_deltas_add_up_and_never_show_half_a_character(byte_bpe):
    prompt = byte_bpe.encode("# ")
    out = byte_bpe.encode(TEXT)
    detok = IncrementalDetokenizer(byte_bpe, prompt)
    deltas = [detok.add([t]) for t in out]
    assert "".join(deltas) == byte_bpe.decode(out) == TEXT
    assert not any("\ufffd" in d for d in deltas)
    assert "" in deltas  # some characters did span several tokens, so text was held back at least once
    assert detok.text == TEXT


def test_flush_releases_an_incomplete_tail(byte_bpe):
    emoji = byte_bpe.encode("😀")
    assert len(emoji) > 1
    detok = IncrementalDetokenizer(byte_bpe)
    assert detok.add(emoji[:-1]) == ""
    assert detok.flush() != ""  # the stream ended mid-character: shown (as U+FFFD), not silently dropped


def test_metaspace_leading_space_comes_from_context():
    """SentencePiece-style '▁world' decodes to 'world' alone but to ' world' after a token: the delta must be
    ' world', which decoding each new token on its own gets wrong."""
    vocab = {"<unk>": 0, "▁hello": 1, "▁world": 2}
    tok = HFTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    t = Tokenizer(tok)
    assert t.decode([2]) == "world"
    detok = IncrementalDetokenizer(t, t.encode("hello"))
    assert detok.add([2]) == " world"


def test_from_file_errors_name_the_file(tmp_path):
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{broken")
    with pytest.raises(ValueError, match=r"tokenizer\.json: not a readable tokenizer\.json"):
        Tokenizer.from_file(str(bad))
    assert Tokenizer.from_dir(str(tmp_path / "missing")) is None
