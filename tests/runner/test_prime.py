"""ModelRunner.prime: every built step program runs once on an all-padding input, before any request is served,
and touches nothing a request could see (live KV pages, the pending tokens)."""

import jax
import numpy as np
import pytest

from cbjax.config.cache import CacheConfig
from cbjax.config.compilation import CompilationConfig
from cbjax.config.parallel import ParallelConfig
from cbjax.model import get_model_config, init_model
from cbjax.runner.build import build_model_runner
from cbjax.runner.step_input import BucketTable

NUM_PAGES = 8


@pytest.fixture(scope="module")
def runner():
    model = init_model(get_model_config("test-tiny"), seed=0)
    buckets = BucketTable.build(max_num_batched_tokens=32, max_model_len=64, page_size=4, max_num_seqs=2)
    return build_model_runner(
        model,
        cache=CacheConfig(page_size=4, num_pages=NUM_PAGES, num_host_pages=0),
        compilation=CompilationConfig(attention_backend="xla"),
        parallel=ParallelConfig(),
        speculative=None,
        num_scheduler_steps=1,
        buckets=buckets,
    )


def test_prime_runs_each_built_program_once_and_leaves_live_pages_alone(runner, monkeypatch):
    rng = np.random.default_rng(0)
    # Live pages hold something a request wrote; prime must leave every one of them as it was.
    runner.kv_caches = [tuple(jax.numpy.asarray(rng.normal(size=a.shape).astype(a.dtype)) for a in layer)
                        for layer in runner.kv_caches]  # fmt: skip
    before = [tuple(np.asarray(a)[:, :NUM_PAGES] for a in layer) for layer in runner.kv_caches]
    pending_tokens = np.asarray(runner.pending_tokens)
    runs = []
    run = runner.run_input
    monkeypatch.setattr(
        runner, "run_input", lambda inp, verify=False: (runs.append(inp.token_ids.shape[0]), run(inp, verify))[1]
    )
    runner.programs.get(runner.buckets.token_buckets[0])  # one program built: only it is primed
    runner.prime()
    assert runs == [runner.buckets.token_buckets[0]]
    runner.warmup("full")  # builds the rest and primes them; the first is not run again
    runner.prime()  # nothing left to run
    assert sorted(runs) == sorted(runner.buckets.token_buckets)
    assert runner.programs.num_primed == len(runner.buckets.token_buckets)
    for layer, saved in zip(runner.kv_caches, before):
        for a, b in zip(layer, saved):
            np.testing.assert_array_equal(np.asarray(a)[:, :NUM_PAGES], b)  # the spare page is NUM_PAGES
    np.testing.assert_array_equal(np.asarray(runner.pending_tokens), pending_tokens)
