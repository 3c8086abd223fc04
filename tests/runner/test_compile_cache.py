"""Start-up costs paid once: a second engine in the same process compiles nothing, and a second process finds
every step program in the persistent compilation cache."""

import json
import subprocess
import sys

from cbjax import LLMEngine, SamplingParams
from tests.helpers import ROOT


# Shapes no other test uses, so the first engine here really compiles (unless a previous run cached them on disk,
# which still counts as a compile: the program is built, from the disk instead of from scratch).
def built(engine) -> int:
    """Step programs an engine built: compiled, or loaded from the program cache of an earlier run."""
    return engine.num_compiles + engine.runner.compiles.num_loaded


SHAPES = dict(max_num_seqs=3, max_num_batched_tokens=40, page_size=8, num_pages=24, max_model_len=96)


def test_a_second_engine_in_the_same_process_compiles_nothing():
    first = LLMEngine("test-tiny", warmup="full", **SHAPES)
    second = LLMEngine("test-tiny", warmup="full", **SHAPES)
    assert built(first) == len(first.buckets.token_buckets)
    assert built(second) == 0


def test_background_warmup_serves_at_once_and_builds_each_program_once():
    """A step whose program is not built yet builds it itself; the background thread builds the rest; every
    program is built exactly once, and nothing compiles once the engine is warm."""
    shapes = {**SHAPES, "max_num_seqs": 5}  # other programs than the test above builds
    engine = LLMEngine("test-tiny", warmup="background", async_scheduling=False, **shapes)
    engine.add_request("a", list(range(3, 40)), SamplingParams(max_tokens=4, temperature=0.0))
    while engine.has_unfinished_requests():
        engine.step()
    engine.wait_until_warm()
    assert engine.runner.programs.num_ready == len(engine.buckets.token_buckets)
    assert built(engine) == len(engine.buckets.token_buckets)
    engine.add_request("b", list(range(3, 20)), SamplingParams(max_tokens=4, temperature=0.0))
    while engine.has_unfinished_requests():
        engine.step()
    assert built(engine) == len(engine.buckets.token_buckets)


_SCRIPT = """
import json
from cbjax import LLMEngine, SamplingParams
engine = LLMEngine("test-tiny", max_num_seqs=2, max_num_batched_tokens=24, page_size=8, num_pages=16,
                   max_model_len=64, warmup="full")
engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=3))
while engine.has_unfinished_requests():
    engine.step()
c = engine.runner.compiles
print(json.dumps(dict(compiles=c.num_compiles, cache_hits=c.num_cache_hits, loaded=c.num_loaded,
                      buckets=len(engine.buckets.token_buckets), cache_dir=engine.compilation_cache_dir)))
"""


def _run(cache_dir, num_devices: int = 1) -> tuple[dict, str]:
    env = {"PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu", "CBJAX_COMPILATION_CACHE": str(cache_dir)}
    if num_devices > 1:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={num_devices}"
    r = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, cwd=ROOT, env=env)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1]), r.stderr


def test_a_second_process_loads_every_step_program_from_the_cache(tmp_path):
    cold, log = _run(tmp_path)
    assert cold["cache_dir"] == str(tmp_path) and str(tmp_path) in log  # the log line says where the cache is
    assert cold["compiles"] == cold["buckets"] and cold["cache_hits"] == 0 and cold["loaded"] == 0
    warm, _ = _run(tmp_path)
    assert warm["loaded"] == warm["buckets"] and warm["compiles"] == 0  # no trace, no compile


def test_saved_programs_load_on_a_host_with_several_devices(tmp_path):
    """A single-device program loaded without naming its device became one for every local device, and its first
    call failed ("Expected ... 2 shards") on multi-chip hosts (found with fake CPU devices)."""
    _run(tmp_path, num_devices=2)
    warm, _ = _run(tmp_path, num_devices=2)  # the script's steps run on the loaded programs
    assert warm["loaded"] == warm["buckets"] and warm["compiles"] == 0


def test_without_saved_programs_jax_persistent_cache_serves_the_compiles(tmp_path):
    _run(tmp_path)
    for saved in (tmp_path / "cbjax-programs").iterdir():
        saved.unlink()
    warm, _ = _run(tmp_path)
    assert warm["loaded"] == 0 and warm["compiles"] == warm["buckets"] and warm["cache_hits"] == warm["buckets"]


def test_the_cache_can_be_turned_off(tmp_path):
    off, _ = _run("off")
    assert off["cache_dir"] is None and off["cache_hits"] == 0
