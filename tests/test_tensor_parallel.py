"""Tensor parallelism on 8 fake CPU devices (a subprocess: the device count is fixed when jax starts): TP 2, 4 and
8 generate one device's greedy tokens, token for token (every policy at TP 2), with parameters and KV pages really
split, nothing compiled after warmup and every page back at the end; an int8 KV cache splits its scales too."""

from cbjax.core.policy_zoo import POLICIES
from tests.helpers import run_on_fake_devices

SCRIPT = """
import json
import numpy as np
from cbjax import LLM, LLMEngine
from cbjax.core.policy_zoo import POLICIES
from cbjax.model import get_model_config, init_model
from tests.helpers import random_workload

import jax

opts = dict(max_num_seqs=4, max_num_batched_tokens=32, page_size=8, num_pages=40, max_model_len=96)
report = {}
# A checkpoint (the packaged tinypy) loads straight into its shards: no device ever holds a whole weight matrix.
tp_engine = LLMEngine("tinypy", tensor_parallel_size=8, warmup="none", **opts)
whole = [a.shape for a in jax.live_arrays() if len(a.devices()) == 1 and a.ndim == 2]
ck_prompts = [[0, 5, 77, 300], [0, 9, 1000, 12, 7]]
from cbjax import SamplingParams
sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
report["tinypy"] = dict(
    whole_matrices_on_one_device=[list(s) for s in whole],
    same=[o.outputs[0].token_ids for o in LLM.from_engine(tp_engine).generate(ck_prompts, sp)]
    == [o.outputs[0].token_ids for o in LLM("tinypy", warmup="none", **opts).generate(ck_prompts, sp)],
)
del tp_engine
model = init_model(get_model_config("test-tiny"), seed=0)
prompts, params = random_workload(10, seed=3, vocab=512, prompt_range=(1, 60), max_tokens_range=(1, 20))
ref = [o.outputs[0].token_ids for o in LLM(model, **opts).generate(prompts, params)]
runs = [(tp, "fcfs") for tp in (2, 4, 8)] + [(2, p) for p in sorted(POLICIES) if p != "fcfs"]
for tp, policy in runs:
    engine = LLMEngine(model, tensor_parallel_size=tp, policy=policy, warmup="full", **opts)
    warm = engine.num_compiles
    got = [o.outputs[0].token_ids for o in LLM.from_engine(engine).generate(prompts, params)]
    runner = engine.runner
    qkv = next(p for p in runner.params if p.shape == (64, 128))  # a layer's fused q|k|v kernel
    k_cache = runner.kv_caches[0][0]
    dev0 = runner.mesh.devices.flat[0]
    replicated = sum(p.nbytes for p in runner.params if p.sharding.is_fully_replicated)
    split = sum(p.nbytes for p in runner.params if not p.sharding.is_fully_replicated)
    on_dev0 = sum(s.data.nbytes for p in runner.params for s in p.addressable_shards if s.device == dev0)
    report[f"{tp}/{policy}"] = dict(
        same=got == ref,
        compiles_after_warmup=engine.num_compiles - warm,
        free=engine.scheduler.pool.num_free,
        devices=len(runner.mesh.devices.flat),
        qkv_shard=list(qkv.addressable_shards[0].data.shape),
        qkv_devices=len(qkv.devices()),
        kv_shard=list(k_cache.addressable_shards[0].data.shape),
        kv_full=list(k_cache.shape),
        param_bytes_on_one_device=on_dev0,
        param_bytes_expected=replicated + split // tp,
        split_fraction=split / (split + replicated),
    )
# The Pallas kernel (interpret mode on CPU) per head shard under shard_map, at TP 2.
few = random_workload(3, seed=5, vocab=512, prompt_range=(1, 40), max_tokens_range=(1, 5))
pallas = dict(attention_backend="pallas", pallas_interpret=True, warmup=False)
engine = LLMEngine(model, tensor_parallel_size=2, **pallas, **opts)
report["pallas"] = dict(
    same=[o.outputs[0].token_ids for o in LLM.from_engine(engine).generate(*few)]
    == [o.outputs[0].token_ids for o in LLM(model, **opts).generate(*few)]
)
# An int8 KV cache at TP 2: its scales split by kv head with the pages.
int8 = LLMEngine(model, tensor_parallel_size=2, kv_cache_dtype="int8", warmup=False, **opts)
report["int8_kv"] = dict(
    same=[o.outputs[0].token_ids for o in LLM.from_engine(int8).generate(*few)]
    == [o.outputs[0].token_ids for o in LLM(model, kv_cache_dtype="int8", **opts).generate(*few)],
    scale_shard=list(int8.runner.kv_caches[0][2].addressable_shards[0].data.shape),
)
# Blocks of decode steps (num_scheduler_steps) at TP 2: the device loop over sharded weights and KV pages.
blocks = LLMEngine(model, tensor_parallel_size=2, num_scheduler_steps=4, warmup="full", **opts)
report["blocks"] = dict(
    same=[o.outputs[0].token_ids for o in LLM.from_engine(blocks).generate(prompts, params)] == ref,
    num_blocks=sum(1 for r in blocks.step_records if r["decode_steps"] > 1),
)
print("REPORT " + json.dumps(report))
"""


def test_tensor_parallel_2_4_8_equal_one_device():
    report = run_on_fake_devices(SCRIPT, 8)
    assert report.pop("pallas")["same"]  # the Pallas kernel runs per shard too
    int8 = report.pop("int8_kv")
    assert int8["same"] and int8["scale_shard"] == [1, 41, 8, 1]  # 2 kv heads split over 2 devices, pages + spare
    tinypy = report.pop("tinypy")
    assert tinypy["same"] and tinypy["whole_matrices_on_one_device"] == []
    blocks = report.pop("blocks")
    assert blocks["same"] and blocks["num_blocks"] > 0
    assert len(report) == 3 + len(POLICIES) - 1  # fcfs at TP 2, 4, 8; every other policy at TP 2
    for run, r in report.items():
        tp = int(run.split("/")[0])
        assert r["same"], run  # greedy tokens equal one device's
        assert r["compiles_after_warmup"] == 0 and r["free"] == 40, run
        assert r["devices"] == tp and r["qkv_devices"] == tp, run
        assert r["qkv_shard"] == [64, 128 // tp], run  # column-parallel: each device holds 1/tp of the columns
        # Per-device bytes: 1/tp of every split array plus the replicated ones (norms); most bytes are split.
        assert r["param_bytes_on_one_device"] == r["param_bytes_expected"] and r["split_fraction"] > 0.9, run
        # test-tiny has 2 kv heads: split at TP 2, replicated beyond (each device keeps them all)
        assert r["kv_shard"] == ([1, *r["kv_full"][1:]] if tp == 2 else r["kv_full"]), run
