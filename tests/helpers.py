"""Shared test helpers: random workloads and the full-forward greedy oracle."""

import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from cbjax import SamplingParams

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository
# A small engine's options for the test-tiny model: 4 slots, 32-token steps, 48 pages of 8 tokens, 96-token contexts.
SMALL_ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=32, page_size=8, num_pages=48, max_model_len=96)


def random_workload(n: int, seed: int, vocab: int, prompt_range=(1, 300), max_tokens_range=(1, 64)):
    rng = np.random.default_rng(seed)
    prompts = [
        rng.integers(3, vocab, int(rng.integers(prompt_range[0], prompt_range[1] + 1))).tolist() for _ in range(n)
    ]
    params = [
        SamplingParams(
            max_tokens=int(rng.integers(max_tokens_range[0], max_tokens_range[1] + 1)), temperature=0.0, ignore_eos=True
        )
        for _ in range(n)
    ]
    return prompts, params


_FWD_CACHE = {}


def greedy_reference(model, prompts, max_tokens, width: int, quantize_kv: bool = False) -> list[list[int]]:
    """Greedy decoding with the plain full-sequence forward (no cache): every request in one padded batch,
    recomputed from scratch at every position. Causal attention makes the padding after each row harmless.
    `quantize_kv`: the oracle of an int8 KV cache (K and V rounded through int8, see Llama.forward_full)."""
    from kernels_pallas import kv_quant

    key = (id(model), quantize_kv)
    round_trip = kv_quant.round_trip if quantize_kv else None
    fwd = _FWD_CACHE.get(key) or _FWD_CACHE.setdefault(
        key, jax.jit(lambda tokens: model.forward_full(tokens, kv_round_trip=round_trip))
    )
    n = len(prompts)
    toks = np.zeros((n, width), np.int32)
    lens = np.array([len(p) for p in prompts])
    for i, p in enumerate(prompts):
        toks[i, : len(p)] = p
    outs = [[] for _ in range(n)]
    for _ in range(max(max_tokens)):
        logits = fwd(jnp.asarray(toks))
        nxt = np.asarray(jnp.argmax(logits[jnp.arange(n), jnp.asarray(lens - 1)], axis=-1))
        for i in range(n):
            if len(outs[i]) < max_tokens[i]:
                outs[i].append(int(nxt[i]))
                toks[i, lens[i]] = nxt[i]
                lens[i] += 1
    return outs


def noisy_copy(model, scale: float, seed: int):
    """The model with Gaussian noise (`scale` times each matrix's spread) on its matrices: a draft that agrees
    with the target often, not always."""
    graphdef, state = nnx.split(model)
    rng = np.random.default_rng(seed)

    def perturb(x):
        x = np.asarray(x)
        if x.ndim < 2:
            return jnp.asarray(x)
        return jnp.asarray(x + scale * x.std() * rng.standard_normal(x.shape).astype(x.dtype))

    return nnx.merge(graphdef, jax.tree.map(perturb, state))


def parse_config(argv, config_file: str = "configs/compare_cpu.py"):
    """Parse `argv` with a --config flag on a private FlagValues, as the absl apps do."""
    from absl import flags
    from ml_collections import config_flags

    fv = flags.FlagValues()
    argv = ["prog", *argv]
    # config_flags defines the --config.<field> flags from the argv it is given, before parsing it.
    holder = config_flags.DEFINE_config_file("config", os.path.join(ROOT, config_file), flag_values=fv, sys_argv=argv)
    fv(argv)
    return holder.value


def drain(engine) -> dict:
    """Step until the engine is idle; the finished outputs by request id."""
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


def run_on_fake_devices(script: str, num_devices: int, timeout: int = 900) -> dict:
    """Run `script` in a fresh Python with `num_devices` fake CPU devices (the count is fixed when jax starts);
    it prints one line "REPORT <json>", returned parsed."""
    import json
    import subprocess
    import sys

    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={num_devices}",
        "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.split("REPORT ", 1)[1])
