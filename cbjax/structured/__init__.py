"""Structured output: a request's StructuredOutputs (JSON schema, regex, choice, Lark grammar, any JSON object)
compiled into a token constraint the engine applies as a mask each step (docs/sampling.md, "Structured output").

Built on llguidance (PyPI `llguidance`, the `structured` extra) rather than xgrammar, the other engine vLLM and
SGLang use: llguidance is one Rust extension with no Python dependencies that writes each mask straight into a
numpy int32 row, while xgrammar's package requires torch, transformers and (on Linux x86-64) triton, and its mask
helpers take torch tensors; cbjax installs none of them to serve (PyPI's torch for Linux is a CUDA build of several
GB). llguidance also builds its lexer lazily (a new small schema costs well under a millisecond before its first
mask, measured on tinypy's tokenizer) and rolls a matcher back over any number of accepted tokens (rejected
speculative drafts). This package imports llguidance, numpy and the model's tokenizer, never jax.

The modules: grammar.py (spec -> llguidance grammar text), constraint.py (GrammarConstraint, the TokenConstraint),
compiler.py (GrammarCompiler and its cache). This file imports none of them, so a cbjax installed without the
extra still imports; `request_constraint` says what is missing when a request asks for structured output.
"""

from collections.abc import Iterable

from cbjax.core.structured_outputs import StructuredOutputs, TokenConstraint


def request_constraint(
    spec: StructuredOutputs, tokenizer, vocab_size: int, eos_token_ids: Iterable[int]
) -> TokenConstraint:
    """The constraint of one request (the engine's add_request): spec compiled for the model's tokenizer (a
    cbjax.model.tokenizer.Tokenizer, or None for a model without one) and vocabulary, through the shared cache.
    ValueError naming the problem: no tokenizer, llguidance not installed, a bad schema, regex or grammar."""
    if tokenizer is None:
        raise ValueError("structured output needs the model's tokenizer (tokenizer.json); this model has none")
    try:
        from cbjax.structured.compiler import compiler_for
    except ImportError as e:
        raise ValueError(f"structured output needs llguidance: pip install 'cbjax[structured]' ({e})") from None
    return compiler_for(tokenizer, vocab_size, eos_token_ids).constraint(spec)
