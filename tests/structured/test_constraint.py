"""GrammarConstraint and GrammarCompiler on the packaged tinypy tokenizer: the mask's bits against a brute-force
reading of the vocabulary, accept/rollback, end of sequence, bad specs, the cache."""

import json

import numpy as np
import pytest

from cbjax.core.structured_outputs import StructuredOutputs
from cbjax.model.registry import packaged_model_path
from cbjax.model.tokenizer import Tokenizer
from cbjax.structured import request_constraint
from cbjax.structured.compiler import GrammarCompiler, compiler_for
from cbjax.structured.grammar import MAX_JSON_INDENT

TOKENIZER = Tokenizer.from_dir(packaged_model_path("tinypy"))
V = TOKENIZER.vocab_size  # 4096, the model's too
EOS = 0  # <|endoftext|>


@pytest.fixture(scope="module")
def compiler():
    return GrammarCompiler(TOKENIZER, V, [EOS])


@pytest.fixture(scope="module")
def token_texts():
    """Each token's own text (byte-level BPE: a token that is part of a multi-byte character decodes to U+FFFD,
    which no ASCII grammar here allows)."""
    return [TOKENIZER.decode([i], skip_special_tokens=False) for i in range(V)]


def allowed(constraint, vocab_size: int = V) -> set[int]:
    row = np.zeros(-(-vocab_size // 32), np.int32)
    constraint.fill_bitmask(row)
    bits = np.unpackbits(row.view(np.uint8), bitorder="little")
    return {int(i) for i in np.flatnonzero(bits)}


def ids(text: str) -> list[int]:
    return TOKENIZER.encode(text, add_special_tokens=False)


def test_choice_mask_is_every_token_that_starts_a_choice(compiler, token_texts):
    choices = ["yes", "no", "maybe so"]
    c = compiler.constraint(StructuredOutputs(choice=choices))
    want = {i for i, t in enumerate(token_texts) if i != EOS and t and any(ch.startswith(t) for ch in choices)}
    assert want and allowed(c) == want
    c.accept(ids("may"))  # "ma", "y"
    # The rest is forced: llguidance allows only the tokens the tokenizer itself would cut it into ("be", not "b"),
    # so the model never sees a tokenization it was not trained on.
    rest = {i for i, t in enumerate(token_texts) if i != EOS and t and "be so".startswith(t)}
    assert allowed(c) < rest and allowed(c) == {ids("maybe so")[2]} == {TOKENIZER.token_to_id("be")}
    c.accept(ids("be so"))
    assert allowed(c) == {EOS} and c.is_finished()


def test_regex_eos_exactly_where_the_output_may_end(compiler, token_texts):
    c = compiler.constraint(StructuredOutputs(regex="[0-9]{1,3}"))
    digits = {i for i, t in enumerate(token_texts) if t and t.isascii() and t.isdigit()}
    assert allowed(c) == {i for i in digits if len(token_texts[i]) <= 3}
    c.accept(ids("12"))
    assert EOS in allowed(c) and not c.is_finished() and c.may_end()  # "12" may end or take one more digit
    assert allowed(c) - {EOS} == {i for i in digits if len(token_texts[i]) == 1}
    c.accept(ids("3"))
    assert allowed(c) == {EOS} and c.is_finished()
    c.accept([EOS])
    assert c.num_accepted == 3


def test_rejected_token_is_a_value_error_and_changes_nothing(compiler):
    c = compiler.constraint(StructuredOutputs(regex="ab+"))
    c.accept(ids("a"))
    before = allowed(c)
    with pytest.raises(ValueError, match="not allowed by the grammar"):
        c.accept(ids("b") + ids("x"))  # the first is fine, the second is not: neither stays
    assert allowed(c) == before and c.num_accepted == 1
    with pytest.raises(ValueError, match="outside the vocabulary"):
        c.accept([V])
    with pytest.raises(ValueError, match="not allowed"):
        c.accept([EOS])  # "a" is not a match yet: no end of sequence
    assert allowed(c) == before


def test_rollback_restores_the_earlier_masks(compiler):
    c = compiler.constraint(StructuredOutputs(json_object=True))
    text = ids('{"k": [1, 2], "z": null}')
    masks = []
    for t in text:
        masks.append(allowed(c))
        c.accept([t])
    assert c.is_finished()
    for back in (1, 4, len(text) - 5):
        c.rollback(back)
        assert allowed(c) == masks[c.num_accepted]
    with pytest.raises(ValueError, match="rollback of 99 tokens"):
        c.rollback(99)
    c.rollback(c.num_accepted)
    assert allowed(c) == masks[0]


def test_end_of_sequence_after_the_end_is_counted_and_rolled_back(compiler):
    """ignore_eos keeps sampling after the grammar is complete: only end-of-sequence ids, taken and rolled back."""
    c = compiler.constraint(StructuredOutputs(choice=["ok"]))
    c.accept(ids("ok") + [EOS, EOS, EOS])
    assert allowed(c) == {EOS} and c.num_accepted == len(ids("ok")) + 3
    with pytest.raises(ValueError, match="after the grammar is complete"):
        c.accept(ids("o"))
    c.rollback(3)
    assert c.is_finished() and allowed(c) == {EOS}
    c.rollback(1)
    assert not c.is_finished() and EOS not in allowed(c)


def test_vocabulary_larger_than_the_tokenizer_never_allows_the_extra_ids(token_texts):
    """A model's embedding may have padding rows past the tokenizer's ids: they are never allowed."""
    big = V + 40
    c = GrammarCompiler(TOKENIZER, big, [EOS]).constraint(StructuredOutputs(regex="[a-z ]*"))
    got = allowed(c, big)
    assert got and max(got) < V and EOS in got
    with pytest.raises(ValueError, match="token 4099 is not allowed"):  # an id of the model's, not the grammar's
        c.accept([V + 3])
    with pytest.raises(ValueError, match=r"shape \(130,\), got int32 \(129,\)"):  # ceil(4136 / 32) words
        c.fill_bitmask(np.zeros(129, np.int32))
    with pytest.raises(ValueError, match="more than the model's vocabulary"):
        GrammarCompiler(TOKENIZER, V - 1, [EOS])


def test_json_schema_follows_the_schema_and_bounds_whitespace(compiler):
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["n"],
        "additionalProperties": False,
    }
    c = compiler.constraint(StructuredOutputs(json=json.dumps(schema)))
    with pytest.raises(ValueError, match="not allowed"):
        c.accept(ids('{"m"'))
    c.accept(ids('{"n": 7'))
    with pytest.raises(ValueError, match="not allowed"):
        c.accept(ids("7"))  # 77 > maximum
    space, newline = TOKENIZER.token_to_id("Ġ"), TOKENIZER.token_to_id("Ċ")  # byte-level BPE's " " and "\n"
    c.accept([space])
    assert space not in allowed(c) and newline not in allowed(c)  # one space, or a line break and an indent
    c.rollback(1)
    c.accept([newline] + [space] * MAX_JSON_INDENT)
    assert space not in allowed(c) and newline not in allowed(c)
    c.accept(ids("}"))
    assert c.is_finished()


@pytest.mark.parametrize(
    "spec, message",
    [
        (StructuredOutputs(regex="a(b"), r"(?s)structured regex: .*unclosed group"),
        (StructuredOutputs(grammar="start: foo"), "structured grammar: .*unknown name"),
        (StructuredOutputs(json={"type": "bogus"}), "structured json: .*bogus"),
        (StructuredOutputs(json="{not json"), "not valid JSON"),
        (StructuredOutputs(json="[1, 2]"), "must be a JSON object, got list"),
        (StructuredOutputs(json={"type": "string", "format": "weird"}), "structured json: .*weird"),
    ],
)
def test_bad_spec_is_a_value_error_naming_the_problem(compiler, spec, message):
    with pytest.raises(ValueError, match=message):
        compiler.constraint(spec)


def test_request_constraint_needs_a_tokenizer_and_an_eos():
    with pytest.raises(ValueError, match="needs the model's tokenizer"):
        request_constraint(StructuredOutputs(regex="a"), None, V, [EOS])
    with pytest.raises(ValueError, match="end-of-sequence"):
        request_constraint(StructuredOutputs(regex="a"), TOKENIZER, V, [])
    assert request_constraint(StructuredOutputs(regex="a"), TOKENIZER, V, [EOS]).fill_bitmask is not None


def test_cache_compiles_each_spec_once_and_evicts_the_least_recent():
    compiler = GrammarCompiler(TOKENIZER, V, [EOS], cache_size=2)
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    first = compiler.constraint(StructuredOutputs(json=schema))
    second = compiler.constraint(StructuredOutputs(json=json.loads(json.dumps(schema))))  # an equal dict
    assert compiler.num_compiled == 1
    first.accept(ids('{"a"'))  # copies of one compiled grammar advance on their own
    assert allowed(second) != allowed(first) and second.num_accepted == 0
    compiler.constraint(StructuredOutputs(regex="x"))
    compiler.constraint(StructuredOutputs(json=schema))  # touched: now the most recent
    compiler.constraint(StructuredOutputs(regex="y"))  # evicts regex "x", the least recent
    assert compiler.cached_specs() == [StructuredOutputs(json=schema), StructuredOutputs(regex="y")]
    assert compiler.num_compiled == 3
    compiler.constraint(StructuredOutputs(regex="x"))
    assert compiler.num_compiled == 4
    with pytest.raises(ValueError, match="cache_size"):
        GrammarCompiler(TOKENIZER, V, [EOS], cache_size=0)


def test_compiler_for_shares_one_compiler_per_tokenizer_vocabulary_and_eos():
    a = compiler_for(TOKENIZER, V, [EOS])
    assert compiler_for(TOKENIZER, V, (EOS, EOS)) is a
    assert compiler_for(TOKENIZER, V + 32, [EOS]) is not a
    assert compiler_for(Tokenizer.from_dir(packaged_model_path("tinypy")), V, [EOS]) is not a
