"""Structured output through LLMEngine: constrained requests batched with unconstrained ones. Each gets exactly
the tokens of the masked full-forward greedy reference (the unconstrained ones: the plain greedy tokens, so the
masks of their neighbours never touch them), and every constrained output parses and validates."""

import json

import jsonschema  # comes with nbformat, in the test extra
import pytest

from cbjax import LLMEngine, SamplingParams
from cbjax.core.structured_outputs import StructuredOutputs
from cbjax.model.hf_loader import load_hf_model
from cbjax.model.registry import packaged_model_path
from cbjax.structured.compiler import compiler_for
from tests.helpers import drain
from tests.structured.reference import constrained_greedy
from tests.structured.test_tinypy_json import EOS, SCHEMA

ENGINE = dict(dtype="float32", max_num_seqs=8, max_num_batched_tokens=64, page_size=16, num_pages=128, warmup="none")
MAX_TOKENS = 160
REQUESTS = [  # (prompt, structured spec or None)
    ("config = ", StructuredOutputs(json=SCHEMA)),
    ("def add(a, b):\n", None),
    ('person = {"name": ', StructuredOutputs(json=SCHEMA)),
    ("import os\n", None),
    ("answer = ", StructuredOutputs(choice=["yes", "no", "maybe so"])),
    ("version = '", StructuredOutputs(regex=r"[0-9]{1,2}\.[0-9]{1,2}")),
    ("class Stack:\n", None),
    ("data = ", StructuredOutputs(json_object=True)),
]


@pytest.fixture(scope="module")
def engine():
    return LLMEngine("tinypy", **ENGINE)


def test_constrained_and_plain_requests_match_the_masked_reference(engine):
    tok = engine.tokenizer
    for i, (prompt, spec) in enumerate(REQUESTS):
        tokens = MAX_TOKENS if spec is not None else 24
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=tokens, temperature=0.0, structured=spec))
    done = drain(engine)
    got = [done[str(i)].outputs[0].token_ids for i in range(len(REQUESTS))]

    model = load_hf_model(packaged_model_path("tinypy"), dtype="float32")
    compiler = compiler_for(tok, model.cfg.vocab_size, [EOS])
    prompts = [tok.encode(p) for p, _ in REQUESTS]
    constraints = [None if spec is None else compiler.constraint(spec) for _, spec in REQUESTS]
    want = constrained_greedy(model, prompts, constraints, MAX_TOKENS, EOS)
    for i, (_, spec) in enumerate(REQUESTS):
        assert got[i] == want[i][: len(got[i])] and len(got[i]) == (len(want[i]) if spec else 24), i
    for i, (_, spec) in enumerate(REQUESTS):
        if spec is not None:
            assert got[i][-1] == EOS and done[str(i)].outputs[0].finish_reason == "stop"
    for i in (0, 2):
        jsonschema.validate(json.loads(tok.decode(got[i])), SCHEMA)
    assert isinstance(json.loads(tok.decode(got[7])), dict)
    assert tok.decode(got[4]) in ("yes", "no", "maybe so")
    assert 3 <= len(tok.decode(got[5])) <= 5 and "." in tok.decode(got[5])


def test_bad_spec_is_refused_for_that_request_only(engine):
    with pytest.raises(ValueError, match=r"(?s)request 'bad': structured regex: .*unclosed group"):
        engine.add_request("bad", "x = ", SamplingParams(structured=StructuredOutputs(regex="a(b")))
    assert "bad" not in engine.requests
    engine.add_request("good", "x = ", SamplingParams(max_tokens=4, structured=StructuredOutputs(regex="[0-9]+")))
    assert drain(engine)["good"].outputs[0].text.isdigit()


def test_a_model_without_a_tokenizer_refuses_structured_output():
    engine = LLMEngine("test-tiny", max_num_seqs=2, max_num_batched_tokens=16, page_size=8, num_pages=8, warmup="none")
    with pytest.raises(ValueError, match="request 'r': structured output needs the model's tokenizer"):
        engine.add_request("r", [5, 6], SamplingParams(structured=StructuredOutputs(json_object=True)))


def test_a_complete_grammar_ends_the_output_before_min_tokens(engine):
    """min_tokens bans EOS, but once the grammar is complete EOS is all it allows: the grammar wins (the output
    ends with EOS, a valid choice) rather than the row allowing nothing. (tinypy's EOS is id 0, which an empty row
    would also give: tests/runner/test_sampling_extras.py checks the rule itself with a token that is not 0.)"""
    spec = StructuredOutputs(choice=["yes", "no"])
    engine.add_request("m", "answer = ", SamplingParams(max_tokens=16, min_tokens=12, temperature=0.0, structured=spec))
    done = drain(engine)["m"]
    tokens = done.outputs[0].token_ids
    assert done.error is None and done.outputs[0].finish_reason == "stop"
    assert tokens[-1] == EOS and len(tokens) < 12
    assert engine.tokenizer.decode(tokens[:-1]) in ("yes", "no")
