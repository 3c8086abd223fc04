"""A request's StructuredOutputs as an llguidance grammar (the text llguidance's matcher compiles).

Each kind maps to one llguidance front end: a JSON schema to its JSON-schema compiler, a regex to a one-rule
grammar, a choice to a Lark grammar of string literals, a Lark grammar as it is, `json_object` to the schema
{"type": "object"}. Nothing is checked here beyond the JSON text of a schema: the grammar's own errors (an unknown
schema keyword, an unclosed regex group, an undefined Lark rule) appear when the matcher is built
(cbjax/structured/compiler.py), which names them.
"""

import json

import llguidance

from cbjax.core.structured_outputs import StructuredOutputs

# Whitespace the JSON grammar allows between tokens: none, one space or tab, or one line break and up to
# MAX_JSON_INDENT spaces or tabs: the layouts json.dumps writes (compact, ", " and ": ", or indented), and no more.
# llguidance's default is any run of whitespace, and a small model's greedy output then fills max_tokens with
# blank lines without ever closing the object (xgrammar bounds whitespace for the same reason).
MAX_JSON_INDENT = 20  # json.dumps(indent=4) five levels deep
JSON_OPTIONS = {"whitespace_pattern": rf"([\x20\x09]|\x0D?\x0A[\x20\x09]{{0,{MAX_JSON_INDENT}}})?"}

ANY_JSON_OBJECT = {"type": "object"}


def grammar_of(spec: StructuredOutputs) -> str:
    """The llguidance grammar text of spec. ValueError for a JSON schema that is not JSON, or not an object."""
    if spec.json is not None or spec.json_object:
        schema = ANY_JSON_OBJECT if spec.json_object else _schema_object(spec.json)
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    if spec.regex is not None:
        return llguidance.LLMatcher.grammar_from_regex(spec.regex)
    if spec.choice is not None:
        # Lark string literals take JSON's escapes, so json.dumps quotes any choice (quotes, backslashes,
        # newlines, non-ASCII) exactly.
        alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.choice)
        return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}")
    return llguidance.LLMatcher.grammar_from_lark(spec.grammar)


def _schema_object(schema: "str | dict") -> dict:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"structured json schema is not valid JSON: {e}") from None
    if not isinstance(schema, dict):
        raise ValueError(f"structured json schema must be a JSON object, got {type(schema).__name__}")
    return schema
