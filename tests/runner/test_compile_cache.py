"""Start-up costs paid once: a second engine in the same process compiles nothing, and a second process finds
every step program in the persistent compilation cache."""

import json
import subprocess
import sys

from cbjax import LLMEngine
from tests.helpers import ROOT

# Shapes no other test uses, so the first engine here really compiles (unless a previous run cached them on disk,
# which still counts as a compile: the program is built, from the disk instead of from scratch).
SHAPES = dict(max_num_seqs=3, max_num_batched_tokens=40, page_size=8, num_pages=24, max_model_len=96)


def test_a_second_engine_in_the_same_process_compiles_nothing():
    first = LLMEngine("test-tiny", **SHAPES)
    second = LLMEngine("test-tiny", **SHAPES)
    assert first.num_compiles == len(first.buckets.token_buckets)
    assert second.num_compiles == 0


_SCRIPT = """
import json
from cbjax import LLMEngine, SamplingParams
engine = LLMEngine("test-tiny", max_num_seqs=2, max_num_batched_tokens=24, page_size=8, num_pages=16,
                   max_model_len=64)
engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=3))
while engine.has_unfinished_requests():
    engine.step()
c = engine.runner.compiles
print(json.dumps(dict(compiles=c.num_compiles, cache_hits=c.num_cache_hits, buckets=len(engine.buckets.token_buckets),
                      cache_dir=engine.compilation_cache_dir)))
"""


def _run(cache_dir) -> tuple[dict, str]:
    env = {"PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu", "CBJAX_COMPILATION_CACHE": str(cache_dir)}
    r = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, cwd=ROOT, env=env)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1]), r.stderr


def test_a_second_process_hits_the_persistent_cache(tmp_path):
    cold, log = _run(tmp_path)
    assert cold["cache_dir"] == str(tmp_path) and str(tmp_path) in log  # the log line says where the cache is
    assert cold["compiles"] == cold["buckets"] and cold["cache_hits"] == 0
    warm, _ = _run(tmp_path)
    assert warm["compiles"] == warm["buckets"] and warm["cache_hits"] == warm["buckets"]


def test_the_cache_can_be_turned_off(tmp_path):
    off, _ = _run("off")
    assert off["cache_dir"] is None and off["cache_hits"] == 0
