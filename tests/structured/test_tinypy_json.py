"""Issue 40's measure of structured output, with no engine: the packaged tinypy model (a Python-code model that
has never been asked for JSON) decoding greedily under a small JSON schema, its full forward's logits masked by
the constraint each step. Every output must parse and validate; without the mask none does."""

import json

import jsonschema  # comes with nbformat, in the test extra
import pytest

from cbjax.core.structured_outputs import StructuredOutputs
from cbjax.model.hf_loader import load_hf_model
from cbjax.model.registry import packaged_model_path
from cbjax.model.tokenizer import Tokenizer
from cbjax.structured.compiler import GrammarCompiler
from tests.structured.reference import constrained_greedy

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "active"],
    "additionalProperties": False,
}
PROMPTS = [
    "",
    "x = ",
    "config = ",
    'person = {"name": ',
    "# a user record as JSON\nuser = ",
    "def load():\n    return ",
    "import json\ndata = json.loads(",
    "class Point:\n    def __init__(self, x, y):\n",
]
MAX_TOKENS = 160  # the outputs take 41 to 81 tokens (float32 on a CPU): room for another machine's rounding
EOS = 0


@pytest.fixture(scope="module")
def tinypy():
    path = packaged_model_path("tinypy")
    return load_hf_model(path, dtype="float32"), Tokenizer.from_dir(path)


def test_every_constrained_output_parses_and_validates(tinypy):
    model, tok = tinypy
    compiler = GrammarCompiler(tok, model.cfg.vocab_size, [EOS])
    prompts = [tok.encode(p) for p in PROMPTS]
    constraints = [compiler.constraint(StructuredOutputs(json=SCHEMA)) for _ in prompts]
    outs = constrained_greedy(model, prompts, constraints, MAX_TOKENS, EOS)
    texts = []
    for out, c in zip(outs, constraints):
        assert out[-1] == EOS and c.is_finished(), tok.decode(out)  # ended by the grammar, not by max_tokens
        texts.append(tok.decode(out))
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)  # raises for an output that does not parse or validate
    assert len(set(texts)) > 1  # the prompts steer the model: not one memorised answer


def test_without_the_mask_no_output_is_json(tinypy):
    """The same model and prompts unconstrained: the schema's outputs above are the mask's doing."""
    model, tok = tinypy
    outs = constrained_greedy(model, [tok.encode(p) for p in PROMPTS], [None] * len(PROMPTS), 40, EOS)
    for out in outs:
        with pytest.raises(json.JSONDecodeError):
            json.loads(tok.decode(out))
