"""The prefix cache's host tier on the real engine: a device pool too small for the working set of shared prefixes,
so cached pages are evicted to host memory and brought back. Greedy tokens equal the full-forward reference (and so
the engine without the tier) across policies, both preemption modes and an int8 KV cache; the tier is really used;
the page pools and the tier stay consistent after every step; nothing compiles after warmup.
(The tier's bookkeeping alone: tests/core/test_host_prefix_cache.py.)"""

import numpy as np
import pytest

from cbjax import LLM, LLMEngine, SamplingParams
from cbjax.model import get_model_config, init_model
from tests.helpers import greedy_reference, run_on_fake_devices

MAX_MODEL_LEN = 176
# All engines share these shapes, so the step programs compile once per KV dtype for the whole module. 16 device
# pages hold one 64-token prefix (4 pages) per running request and little else: the 4 prefixes do not stay cached.
OPTS = dict(
    max_num_seqs=3,
    max_num_batched_tokens=64,
    page_size=16,
    max_model_len=MAX_MODEL_LEN,
    num_pages=16,
    watermark_fraction=0.0,
    enable_prefix_caching=True,
)


@pytest.fixture(scope="module")
def model():
    return init_model(get_model_config("test-tiny"), seed=0)


@pytest.fixture(scope="module")
def workload(model):
    """4 waves of 3 requests; each starts with one of 4 prefixes of 64 tokens, in turn, so a prefix comes back after
    the others have pushed it off the device."""
    rng = np.random.default_rng(3)
    V = model.cfg.vocab_size
    prefixes = [rng.integers(3, V, 64).tolist() for _ in range(4)]
    waves = [
        [prefixes[(w + i) % 4] + rng.integers(3, V, int(rng.integers(1, 24))).tolist() for i in range(3)]
        for w in range(4)
    ]
    prompts = [p for wave in waves for p in wave]
    max_tokens = [int(n) for n in rng.integers(1, 16, len(prompts))]
    refs = {q: greedy_reference(model, prompts, max_tokens, MAX_MODEL_LEN, quantize_kv=q) for q in (False, True)}
    return waves, max_tokens, refs


def run_waves(engine, waves, max_tokens) -> dict[int, list[int]]:
    """Each wave runs to completion before the next arrives; the pools are checked after every step."""
    got, i = {}, 0
    for wave in waves:
        for prompt in wave:
            params = SamplingParams(max_tokens=max_tokens[i], temperature=0.0, ignore_eos=True)
            engine.add_request(str(i), prompt, params, priority=i % 3)
            i += 1
        while engine.has_unfinished_requests():
            got |= {int(o.request_id): o.outputs[0].token_ids for o in engine.step() if o.finished}
            engine.scheduler.pool.check_consistent()  # (and the host tier's: PagePool checks its tier)
            host_pool = engine.scheduler.host_pool
            if host_pool is not None:
                host_pool.check_consistent()
    return got


@pytest.mark.parametrize(
    "policy, mode, kv",
    [
        ("fcfs", "recompute", "auto"),
        ("fcfs", "swap", "auto"),
        ("lpm", "recompute", "auto"),
        ("lpm", "swap", "int8"),
        ("priority", "swap", "auto"),
        ("priority", "recompute", "int8"),
    ],
)
def test_host_tier_is_token_exact_and_used(model, workload, policy, mode, kv):
    waves, max_tokens, refs = workload
    engine = LLMEngine(
        model,
        policy=policy,
        preemption_mode=mode,
        num_host_pages=32 if mode == "swap" else None,
        num_host_cache_pages=48,
        kv_cache_dtype=kv,
        **OPTS,
    )
    engine.wait_until_warm()
    compiles = engine.num_compiles
    got = run_waves(engine, waves, max_tokens)
    ref = refs[kv == "int8"]
    mismatches = [i for i in range(len(ref)) if got.get(i) != ref[i]]
    assert not mismatches, f"{policy}/{mode}/{kv}: requests {mismatches} differ from the full-forward reference"
    assert engine.num_compiles == compiles, "compiled after warmup"
    sched, tier = engine.scheduler, engine.scheduler.host_cache
    assert sched.pool.num_free == sched.pool.num_pages, "device page leak"
    assert tier.hit_tokens > 0 and tier.num_pages_in > 0, "the pool was meant to be too small for the prefixes"
    assert tier.num_cached == min(tier.num_pages, tier.num_pages_out)  # inclusive: nothing copied out is lost early
    steps = engine.step_records
    assert sum(s["prefix_host_hit_tokens"] for s in steps) == tier.hit_tokens
    assert sum(s["host_cache_in_pages"] for s in steps) == tier.num_pages_in
    assert sum(s["host_cache_out_pages"] for s in steps) == tier.num_pages_out
    pages_moved = tier.num_pages_in + tier.num_pages_out + sched.num_swapped_in_pages + sched.num_swapped_out_pages
    bytes_moved = sum(s["swap_out_bytes"] + s["swap_in_bytes"] for s in steps)
    assert bytes_moved == pages_moved * engine.runner.host_pool.bytes_per_page
    if mode == "swap":
        assert sched.host_pool.num_free == sched.host_pool.num_pages
        # The swap pool's host pages come first in the runner's host arrays, the tier's after them.
        assert engine.runner.host_pool.num_host_pages == sched.host_pool.num_pages + tier.num_pages


def test_without_the_tier_the_same_workload_recomputes(model, workload):
    """The baseline of the tests above: same tokens, fewer prefix hits (the evicted prefixes are computed again)."""
    waves, max_tokens, refs = workload
    plain = LLMEngine(model, **OPTS)
    assert run_waves(plain, waves, max_tokens) == dict(enumerate(refs[False]))
    tiered = LLMEngine(model, num_host_cache_pages=48, **OPTS)
    run_waves(tiered, waves, max_tokens)
    assert plain.scheduler.host_cache is None
    assert tiered.scheduler.pool.hit_tokens > plain.scheduler.pool.hit_tokens


def test_offline_llm_with_blocks_of_decode_steps(model, workload):
    """The offline facade decodes in blocks of steps (OFFLINE_OVERRIDES), whose pages may evict cached ones."""
    waves, max_tokens, refs = workload
    llm = LLM(model, num_host_cache_pages=48, **OPTS)
    got, i = [], 0
    for wave in waves:
        params = [SamplingParams(max_tokens=max_tokens[i + k], temperature=0.0, ignore_eos=True) for k in range(3)]
        got += [o.outputs[0].token_ids for o in llm.generate(wave, params)]
        i += len(wave)
    assert got == refs[False]
    assert llm.engine.scheduler.host_cache.hit_tokens > 0
    assert any(s["decode_steps"] > 1 for s in llm.engine.step_records)


def test_host_cache_gib_sizes_the_tier_and_llm_passes_it(model):
    llm = LLM(model, host_cache_gib=1 / 1024, warmup="none", **OPTS)
    tier = llm.engine.scheduler.host_cache
    page_bytes = llm.engine.runner.host_pool.bytes_per_page
    assert tier.num_pages == 2**20 // page_bytes and llm.engine.runner.host_pool.num_host_pages == tier.num_pages
    with pytest.raises(ValueError, match="set enable_prefix_caching=True"):
        LLMEngine(model, host_cache_gib=1.0, **dict(OPTS, enable_prefix_caching=False))


def test_the_simulator_prices_the_tiers_copies_over_the_host_link(workload):
    """On the simulator the tier's copies travel in the swap lists: each step's swap_bytes counts them, and the
    roofline charges them (sim/features.py, sim/roofline.py: swap_bytes / the host link's bandwidth)."""
    import dataclasses

    waves, max_tokens, _ = workload
    engine = LLMEngine("llama-tiny", runner="sim", sim_accelerator="h200", num_host_cache_pages=48, **OPTS)
    runner, priced = engine.runner, 0
    i = 0
    for wave in waves:
        for prompt in wave:
            engine.add_request(str(i), prompt, SamplingParams(max_tokens=max_tokens[i], ignore_eos=True))
            i += 1
        while engine.has_unfinished_requests():
            engine.step()
            step = runner.last_step
            copies = len(step.out.swap_out) + len(step.out.swap_in)
            assert step.features.swap_bytes == copies * runner.kv_bytes_per_page
            if copies:
                free = dataclasses.replace(step.features, swap_bytes=0)
                assert runner.cost_model.step_time(step.features) > runner.cost_model.step_time(free)
                priced += 1
    tier = engine.scheduler.host_cache
    assert priced > 0 and tier.num_pages_in > 0 and tier.num_pages_out > 0


TP_SCRIPT = """
import json
import numpy as np
from cbjax import LLMEngine, SamplingParams
from cbjax.model import get_model_config, init_model
from tests.helpers import greedy_reference
from tests.test_host_prefix_cache import MAX_MODEL_LEN, OPTS

model = init_model(get_model_config("test-tiny"), seed=0)
rng = np.random.default_rng(3)
prefixes = [rng.integers(3, 512, 64).tolist() for _ in range(4)]
prompts = [prefixes[(w + i) % 4] + rng.integers(3, 512, 9).tolist() for w in range(4) for i in range(3)]
report = {}
for kv, mode in (("auto", "swap"), ("int8", "recompute")):
    ref = greedy_reference(model, prompts, [6] * len(prompts), MAX_MODEL_LEN, quantize_kv=kv == "int8")
    engine = LLMEngine(model, tensor_parallel_size=2, preemption_mode=mode, num_host_cache_pages=48,
                       kv_cache_dtype=kv, **OPTS)
    engine.wait_until_warm()
    warm, got = engine.num_compiles, {}
    for w in range(4):
        for i in range(3 * w, 3 * w + 3):
            engine.add_request(str(i), prompts[i], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
        while engine.has_unfinished_requests():
            got |= {int(o.request_id): o.outputs[0].token_ids for o in engine.step() if o.finished}
            engine.scheduler.pool.check_consistent()
    report[kv] = dict(same=[got[i] for i in range(len(prompts))] == ref,
                      host_hits=engine.scheduler.host_cache.hit_tokens, compiles=engine.num_compiles - warm,
                      devices=len(engine.runner.mesh.devices.flat))
print("REPORT " + json.dumps(report))
"""


def test_host_tier_under_tensor_parallelism():
    """TP 2 on 2 fake CPU devices: the tier's copies gather and scatter sharded KV pages (and int8 scales)."""
    for kv, r in run_on_fake_devices(TP_SCRIPT, 2).items():
        assert r["same"] and r["host_hits"] > 0 and r["compiles"] == 0 and r["devices"] == 2, (kv, r)
