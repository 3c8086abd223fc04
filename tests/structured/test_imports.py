"""cbjax/structured/ needs llguidance, numpy and a tokenizer, never jax: a constraint is built and advanced with
jax, jaxlib and flax blocked (the tokenizer read with the `tokenizers` library, as cbjax.model.tokenizer reads it)."""

import subprocess
import sys

from tests.helpers import ROOT

CODE = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('jax', 'jaxlib', 'flax'):
            raise ImportError('blocked: ' + name)
sys.meta_path.insert(0, Block())
import numpy as np
from tokenizers import Tokenizer
from cbjax.core.structured_outputs import StructuredOutputs
from cbjax.structured import request_constraint

class Tok:  # the two things the compiler reads of a tokenizer
    def __init__(self, path):
        self.tok = Tokenizer.from_file(path)
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
    def save(self, path):
        self.tok.save(path)

tok = Tok('cbjax/assets/tinypy/tokenizer.json')
c = request_constraint(StructuredOutputs(choice=['yes', 'no']), tok, tok.vocab_size, [0])
row = np.zeros(tok.vocab_size // 32, np.int32)
c.fill_bitmask(row)
c.accept(tok.tok.encode('yes', add_special_tokens=False).ids)
assert c.is_finished() and row.any()
assert not [m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'flax')]
print('ok')
"""


def test_structured_output_needs_no_jax():
    r = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"
