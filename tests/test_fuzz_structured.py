"""Fuzzing structured output (hypothesis): random specs (JSON schemas, regexes, choices, Lark grammars) compiled for
tinypy's tokenizer (cbjax/structured/) are a ValueError or a constraint whose masks hold."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.fuzz_values import FUZZ, junk, maybe

LEAF_SCHEMAS = [
    {"type": "string"}, {"type": "integer", "minimum": 3}, {"type": "number"}, {"type": "boolean"}, {"type": "null"},
    {}, {"type": "bogus"}, {"enum": [1, "a", None]}, {"const": "x"}, {"type": "string", "maxLength": 2},
    {"type": "string", "pattern": "^a+$"}, {"type": "string", "format": "email"},
]  # fmt: skip


def schema_text(schema) -> str:
    import json

    return json.dumps(schema)


schemas = st.recursive(
    st.sampled_from(LEAF_SCHEMAS),
    lambda inner: st.one_of(
        st.dictionaries(st.text(max_size=3), inner, max_size=3).map(lambda p: {"type": "object", "properties": p}),
        inner.map(lambda i: {"type": "array", "items": i, "maxItems": 3}),
        st.lists(inner, min_size=1, max_size=3).map(lambda xs: {"anyOf": xs}),
    ),
    max_leaves=6,
)
REGEX_PIECES = ["a", "b+", "[0-9]", "(a|bc)", ".", r"\d{1,2}", "x?", "[^a]", " ", "\n"]
BROKEN_REGEX_PIECES = ["(", "]", "{2}", "*", "\\", "a{3,1}"]
regex_texts = st.one_of(
    st.lists(st.sampled_from(REGEX_PIECES), max_size=5).map("".join),
    st.lists(st.sampled_from(REGEX_PIECES + BROKEN_REGEX_PIECES), max_size=4).map("".join),
    st.text(max_size=8),
)
LARK_ITEMS = ['"a"', '"bc"', "/[0-9]+/", "x", "|", "(", ")", "*", "?", '"\\n"', "%ignore", ""]
lark_texts = st.one_of(
    st.lists(st.sampled_from(LARK_ITEMS), max_size=5).map(lambda body: "start: " + " ".join(body) + '\nx: "y"'),
    st.text(max_size=16),
)
structured_specs = st.one_of(
    st.tuples(st.just("json"), st.one_of(schemas, schemas.map(schema_text), junk)),
    st.tuples(st.just("regex"), maybe(regex_texts)),
    st.tuples(st.just("choice"), maybe(st.lists(st.text(max_size=5), max_size=3))),
    st.tuples(st.just("grammar"), maybe(lark_texts)),
    st.tuples(st.just("json_object"), maybe(st.just(True))),
)


@pytest.fixture(scope="module")
def structured_compiler():
    from cbjax.model.registry import packaged_model_path
    from cbjax.model.tokenizer import Tokenizer
    from cbjax.structured.compiler import GrammarCompiler

    tok = Tokenizer.from_dir(packaged_model_path("tinypy"))
    return GrammarCompiler(tok, tok.vocab_size + 40, [0])  # 40 ids past the tokenizer's: never allowed


@FUZZ
@given(structured_specs, st.lists(st.integers(0, 2**31), max_size=10), st.integers(0, 12))
def test_structured_spec_compiles_or_raises_value_error_and_masks_hold(structured_compiler, spec, picks, back):
    """A random spec is a ValueError or a constraint whose masks never allow an id past the tokenizer's, that
    takes every token its mask allows, refuses (unchanged) a token it does not, and rolls back to earlier masks."""
    from cbjax.core.structured_outputs import StructuredOutputs
    from tests.structured.reference import allowed_tokens

    kind, value = spec
    try:
        c = structured_compiler.constraint(StructuredOutputs(**{kind: value}))
    except ValueError:
        return
    V = structured_compiler.vocab_size
    masks = []
    for pick in picks:
        mask = allowed_tokens(c, V)
        assert not mask[V - 40 :].any()
        masks.append(mask)
        if not mask.any():
            break
        refused = np.flatnonzero(~mask)
        if len(refused):
            with pytest.raises(ValueError, match="structured output"):
                c.accept([int(refused[pick % len(refused)])])
            assert (allowed_tokens(c, V) == mask).all()
        ok = np.flatnonzero(mask)
        c.accept([int(ok[pick % len(ok)])])
    back = min(back, c.num_accepted)
    c.rollback(back)
    if back and c.num_accepted < len(masks):
        assert (allowed_tokens(c, V) == masks[c.num_accepted]).all()
