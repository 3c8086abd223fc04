"""GrammarCompiler: StructuredOutputs -> GrammarConstraint for one tokenizer, compiled grammars cached.

Compiling a grammar (a JSON schema's lexer and parser tables) costs from well under a millisecond to a second for
a large schema, and a server sees the same few schemas again and again; so each compiler keeps the compiled
matchers of its most recently used specs (an LRU with a bound) and hands every request a copy, which shares the
compiled tables. `compiler_for` keeps one compiler per (tokenizer, vocabulary size, eos ids), so the cache is keyed
by the spec and the tokenizer, and an engine needs no state of its own for it.
"""

import collections
import os
import tempfile
import threading
import weakref
from collections.abc import Iterable
from typing import Protocol

import llguidance

from cbjax.core.structured_outputs import StructuredOutputs
from cbjax.structured.constraint import GrammarConstraint
from cbjax.structured.grammar import grammar_of


class Tokenizer(Protocol):
    """What the compiler reads of a tokenizer (cbjax.model.tokenizer.Tokenizer has it): its size, and its
    tokenizer.json, which llguidance reads to build its own token trie."""

    @property
    def vocab_size(self) -> int: ...

    def save(self, path: str) -> None: ...


DEFAULT_CACHE_SIZE = 128  # compiled grammars kept per compiler
SPEC_KINDS = ("json", "regex", "choice", "grammar")  # the StructuredOutputs fields that hold a spec


class GrammarCompiler:
    """Compiles StructuredOutputs for one tokenizer and a model's vocabulary (vocab_size >= the tokenizer's; the
    ids past it are never allowed). `eos_token_ids`: the ids that end a sequence (allowed where the grammar may
    end). Thread-safe: a server may add requests from another thread than the engine's loop."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        eos_token_ids: Iterable[int],
        cache_size: int = DEFAULT_CACHE_SIZE,
    ):
        eos = sorted({int(t) for t in eos_token_ids})
        if not eos:
            raise ValueError("structured output needs an end-of-sequence token id; this model has none")
        if cache_size < 1:
            raise ValueError(f"cache_size must be >= 1, got {cache_size}")
        if tokenizer.vocab_size > vocab_size:
            raise ValueError(
                f"the tokenizer has {tokenizer.vocab_size} tokens, more than the model's vocabulary ({vocab_size})"
            )
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(eos)
        self.cache_size = cache_size
        self._ll_tokenizer = llguidance.LLTokenizer(_tokenizer_json(tokenizer), n_vocab=vocab_size, eos_token=eos)
        # Errors name the grammar's problem without dumping the parser's state and the whole grammar.
        self._limits = llguidance.LLParserLimits(verbose_errors=False)
        self._compiled: collections.OrderedDict[StructuredOutputs, llguidance.LLMatcher] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.num_compiled = 0  # grammars compiled (cache misses), for the tests and the benchmark

    def constraint(self, spec: StructuredOutputs) -> GrammarConstraint:
        """A fresh constraint for spec, at the start of the output. ValueError (naming the problem) for a bad
        schema, regex or grammar."""
        if not isinstance(spec, StructuredOutputs):
            raise ValueError(f"structured output spec must be StructuredOutputs, got {type(spec).__name__}")
        try:
            hash(spec)  # a schema dict is hashed as its JSON text
        except TypeError as e:
            raise ValueError(f"structured json schema is not JSON ({e})") from None
        with self._lock:
            matcher = self._compiled.get(spec)
            if matcher is None:
                matcher = self._compile(spec)
                self._compiled[spec] = matcher
                if len(self._compiled) > self.cache_size:
                    self._compiled.popitem(last=False)
            else:
                self._compiled.move_to_end(spec)
            fresh = matcher.deep_copy()
        return GrammarConstraint(fresh, self.vocab_size, self.eos_token_ids)

    def cached_specs(self) -> list[StructuredOutputs]:
        """The specs whose compiled grammars are kept, least recently used first."""
        with self._lock:
            return list(self._compiled)

    def _compile(self, spec: StructuredOutputs) -> llguidance.LLMatcher:
        kind = "json_object" if spec.json_object else next(k for k in SPEC_KINDS if getattr(spec, k) is not None)
        grammar = grammar_of(spec)
        # The matcher never raises for a grammar's errors: it starts in an error state that names them.
        matcher = llguidance.LLMatcher(self._ll_tokenizer, grammar, log_level=0, limits=self._limits)
        if matcher.is_error():
            raise ValueError(f"structured {kind}: {matcher.get_error().strip()}")
        self.num_compiled += 1
        return matcher


def _tokenizer_json(tokenizer: Tokenizer) -> str:
    """The tokenizer.json text llguidance reads (it builds its own token trie from the same file)."""
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "tokenizer.json")
        tokenizer.save(path)
        with open(path, encoding="utf-8") as f:
            return f.read()


_COMPILERS: "weakref.WeakKeyDictionary[Tokenizer, dict]" = weakref.WeakKeyDictionary()
_COMPILERS_LOCK = threading.Lock()


def compiler_for(tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Iterable[int]) -> GrammarCompiler:
    """The shared compiler of this tokenizer for this vocabulary and eos ids (built on first use; it lives as long
    as the tokenizer)."""
    key = (vocab_size, tuple(sorted({int(t) for t in eos_token_ids})))
    with _COMPILERS_LOCK:
        per_tokenizer = _COMPILERS.setdefault(tokenizer, {})
        compiler = per_tokenizer.get(key)
        if compiler is None:
            compiler = per_tokenizer[key] = GrammarCompiler(tokenizer, vocab_size, key[1])
        return compiler
