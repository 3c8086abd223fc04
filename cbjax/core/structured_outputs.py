"""What a structured output must follow (vLLM's StructuredOutputsParams shape), and the per-request constraint the
engine advances token by token.

This module is plain data and a protocol: the grammar engine behind it lives in cbjax/structured/ (the request's
`StructuredOutputs` is compiled into a `TokenConstraint` when the request is added).
"""

import json as json_text
from dataclasses import dataclass
from typing import Protocol

import numpy as np


@dataclass(frozen=True)
class StructuredOutputs:
    """Exactly one of: `json` (a JSON schema, as a dict or its text), `regex`, `choice` (the output is one of
    these strings), `grammar` (a Lark grammar), or `json_object=True` (any JSON object)."""

    json: "str | dict | None" = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self):
        given = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object is True else []
        if self.json_object not in (True, False):
            raise ValueError(f"structured json_object must be True or False, got {self.json_object!r}")
        if len(given) != 1:
            raise ValueError(
                f"structured output needs one of json, regex, choice, grammar, json_object; got {given or 'none'}"
            )
        if self.choice is not None:
            choice = (self.choice,) if isinstance(self.choice, str) else self.choice
            if not isinstance(choice, (list, tuple)) or not choice or not all(isinstance(c, str) for c in choice):
                raise ValueError(f"structured choice must be a non-empty list of strings, got {self.choice!r}")
            object.__setattr__(self, "choice", tuple(choice))
        for k in ("regex", "grammar"):
            v = getattr(self, k)
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"structured {k} must be a non-empty string, got {v!r}")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError(f"structured json must be a JSON schema (dict or str), got {type(self.json).__name__}")
        if isinstance(self.json, dict):
            try:  # (its canonical text is also what the params hash)
                json_text.dumps(self.json, sort_keys=True)
            except (TypeError, ValueError) as e:
                raise ValueError(f"structured json: the schema dict is not JSON ({e})") from None

    def __hash__(self):  # a dict schema is not hashable: hash its canonical text
        schema = self.json if not isinstance(self.json, dict) else json_text.dumps(self.json, sort_keys=True)
        return hash((schema, self.regex, self.choice, self.grammar, self.json_object))


class TokenConstraint(Protocol):
    """One request's structured-output state: which tokens may come next, advanced by each accepted token.

    The engine holds one per constrained request. Before a step that samples the request's next token it calls
    `fill_bitmask(row)`; after the token arrives, `accept(tokens)`; a speculative step whose drafts were partly
    rejected calls `rollback(n)` for the n tokens it takes back."""

    def fill_bitmask(self, row: np.ndarray) -> None:
        """Write the allowed next tokens into row (int32 [ceil(V / 32)]: bit i % 32 of word i // 32 set = token i
        allowed)."""

    def accept(self, tokens: list[int]) -> None:
        """Advance over tokens (the sampler only ever picks allowed ones; a disallowed one raises ValueError)."""

    def rollback(self, num_tokens: int) -> None:
        """Take back the last num_tokens accepted tokens."""

    def is_finished(self) -> bool:
        """The grammar is complete and allows nothing more but the end of the output."""
