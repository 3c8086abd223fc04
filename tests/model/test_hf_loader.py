"""The Hugging Face loader without transformers: export/load round trips for every architecture feature, stored
dtypes, sharded checkpoints, and a clear ValueError (naming the file and tensor) for every broken checkpoint."""

import json
import os
import pathlib

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from cbjax import LLMEngine, SamplingParams
from cbjax.model import get_model_config, init_model
from cbjax.model.checkpoint import params_of
from cbjax.model.hf_loader import load_hf_model, read_hf_config, save_hf_model

BASE = get_model_config("test-tiny").replace(vocab_size=128, max_position_embeddings=64)
VARIANTS = {
    "llama-llama3-rope": BASE.replace(
        rope_scaling=(
            ("rope_type", "llama3"),
            ("factor", 8.0),
            ("high_freq_factor", 4.0),
            ("low_freq_factor", 1.0),
            ("original_max_position_embeddings", 16.0),
        ),
        rope_theta=500.0,
    ),
    "llama-linear-rope-tied": BASE.replace(
        rope_scaling=(("rope_type", "linear"), ("factor", 2.0)), tie_word_embeddings=True
    ),
    "mistral-window": BASE.replace(sliding_window=4),
    "qwen2-bias": BASE.replace(qkv_bias=True, tie_word_embeddings=True),
    "qwen3-qknorm": BASE.replace(qk_norm=True, head_dim=32),
}
TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 128, (2, 20)))


def _export(tmp_path, cfg=BASE, dtype="float32", seed=0):
    model = init_model(cfg, seed)
    path = str(tmp_path / "ckpt")
    save_hf_model(model, path, dtype=dtype)
    return model, path


@pytest.mark.parametrize("name", list(VARIANTS))
def test_export_then_load_gives_the_same_model(tmp_path, name):
    cfg = VARIANTS[name]
    model, path = _export(tmp_path, cfg)
    loaded = load_hf_model(path)
    assert loaded.cfg == cfg
    np.testing.assert_array_equal(np.asarray(loaded.forward_full(TOKENS)), np.asarray(model.forward_full(TOKENS)))


@pytest.mark.parametrize("stored", ["bfloat16", "float16"])
def test_half_precision_weights_load_in_their_dtype_or_cast(tmp_path, stored):
    model, path = _export(tmp_path, dtype=stored)
    half = np.dtype(ml_dtypes.bfloat16 if stored == "bfloat16" else np.float16)
    native = load_hf_model(path)  # default: the checkpoint's own dtype
    assert native.cfg.dtype == stored and native.embed.embedding[...].dtype == half
    as_f32 = load_hf_model(path, dtype="float32")
    assert as_f32.cfg.dtype == "float32"
    want = params_of(model)
    got = params_of(as_f32)
    w = np.asarray(want["layers"][0]["attn"]["qkv_proj"]["kernel"])
    g = np.asarray(got["layers"][0]["attn"]["qkv_proj"]["kernel"])
    assert g.dtype == np.float32
    np.testing.assert_array_equal(g, w.astype(half).astype(np.float32))  # exactly the stored values


def test_sharded_checkpoint_loads_and_a_missing_shard_is_named(tmp_path):
    model, path = _export(tmp_path)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    os.remove(os.path.join(path, "model.safetensors"))
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, os.path.join(path, file))
    index = {"metadata": {}, "weight_map": {k: f for f, keys in shards.items() for k in keys}}
    pathlib.Path(path, "model.safetensors.index.json").write_text(json.dumps(index))
    loaded = load_hf_model(path)
    np.testing.assert_array_equal(np.asarray(loaded.forward_full(TOKENS)), np.asarray(model.forward_full(TOKENS)))
    os.remove(os.path.join(path, "model-00002-of-00002.safetensors"))
    with pytest.raises(ValueError, match=r"model-00002-of-00002\.safetensors: shard not found"):
        load_hf_model(path)


def _rewrite_tensors(path, edit):
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file)


def _edit_config(path, **changes):
    file = os.path.join(path, "config.json")
    hf = json.loads(pathlib.Path(file).read_text())
    hf.update(changes)
    pathlib.Path(file).write_text(json.dumps(hf))


def _delete(name):
    return lambda t: t.pop(name)


def _set(name, value):
    def edit(t):
        t[name] = value(t[name])

    return edit


def _add(name):
    return lambda t: t.update({name: np.zeros(4, np.float32)})


TENSOR_DAMAGE = [
    (
        "missing tensor",
        _delete("model.layers.1.mlp.up_proj.weight"),
        r"model\.safetensors: tensor 'model\.layers\.1\.mlp\.up_proj\.weight' is missing",
    ),
    (
        "wrong shape",
        _set("model.layers.0.self_attn.k_proj.weight", lambda a: a[:, :-1]),
        r"model\.safetensors: tensor 'model\.layers\.0\.self_attn\.k_proj\.weight' has shape \(32, 63\), expected "
        r"\(32, 64\)",
    ),
    (
        "non-finite values",
        _set("model.norm.weight", lambda a: np.where(np.arange(a.size) == 3, np.nan, a)),
        r"model\.safetensors: tensor 'model\.norm\.weight' has non-finite values",
    ),
    (
        "integer tensor",
        _set("model.embed_tokens.weight", lambda a: a.astype(np.int32)),
        r"tensor 'model\.embed_tokens\.weight' has dtype int32",
    ),
    ("unexpected tensor", _add("model.layers.0.mlp.gate_proj.bias"), r"unexpected tensors .*gate_proj\.bias"),
]


@pytest.mark.parametrize("name,edit,message", TENSOR_DAMAGE, ids=[d[0] for d in TENSOR_DAMAGE])
def test_damaged_tensor_is_refused_naming_file_and_tensor(tmp_path, name, edit, message):
    _, path = _export(tmp_path)
    _rewrite_tensors(path, edit)
    with pytest.raises(ValueError, match=message):
        load_hf_model(path)


def test_truncated_safetensors_file_is_refused_naming_the_file(tmp_path):
    _, path = _export(tmp_path)
    file = os.path.join(path, "model.safetensors")
    data = pathlib.Path(file).read_bytes()
    pathlib.Path(file).write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"model\.safetensors: not a readable safetensors file"):
        load_hf_model(path)


def _update(**changes):
    return lambda hf: hf.update(changes)


CONFIG_DAMAGE = [
    (
        "unsupported architecture",
        _update(architectures=["GPT2LMHeadModel"]),
        r"config\.json: unsupported architecture 'GPT2LMHeadModel'",
    ),
    (
        "unsupported rope type",
        _update(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}),
        r"config\.json: unsupported rope scaling type 'yarn'",
    ),
    ("unsupported activation", _update(hidden_act="gelu"), r"config\.json: unsupported hidden_act 'gelu'"),
    ("o_proj bias", _update(attention_bias=True), r"config\.json: attention_bias=true"),
    ("missing field", lambda hf: hf.pop("hidden_size"), r"config\.json: missing fields \['hidden_size'\]"),
    ("bad head count", _update(num_key_value_heads=3), r"config\.json: num_heads \(4\) must be a multiple"),
    (
        "mixed qwen windows",
        _update(
            architectures=["Qwen2ForCausalLM"],
            use_sliding_window=True,
            sliding_window=8,
            layer_types=["full_attention", "sliding_attention"],
        ),
        r"config\.json: sliding window on only some layers",
    ),
]


@pytest.mark.parametrize("name,edit,message", CONFIG_DAMAGE, ids=[d[0] for d in CONFIG_DAMAGE])
def test_bad_config_is_refused_naming_config_json(tmp_path, name, edit, message):
    _, path = _export(tmp_path)
    file = os.path.join(path, "config.json")
    hf = json.loads(pathlib.Path(file).read_text())
    edit(hf)
    pathlib.Path(file).write_text(json.dumps(hf))
    with pytest.raises(ValueError, match=message):
        load_hf_model(path)


def test_config_that_is_not_json_is_refused(tmp_path):
    _, path = _export(tmp_path)
    pathlib.Path(path, "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"config\.json: not valid JSON"):
        load_hf_model(path)


def test_eos_list_from_generation_config(tmp_path):
    """generation_config.json wins over config.json; a list of eos ids ends a request on any of them."""
    _, path = _export(tmp_path)
    _edit_config(path, eos_token_id=9)
    pathlib.Path(path, "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 7, 11], "bos_token_id": 3}))
    cfg = read_hf_config(path)
    assert (cfg.eos_token_id, cfg.extra_eos_token_ids, cfg.bos_token_id) == (5, (7, 11), 3)
    engine = LLMEngine(path, max_num_seqs=2, max_num_batched_tokens=16, page_size=8, num_pages=8, warmup=False)
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=4, stop_token_ids=[20]))
    engine.add_request("b", [1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True))
    assert engine.requests["a"].params.stop_token_ids == (20, 7, 11)
    assert engine.requests["b"].params.stop_token_ids == ()


def test_engine_takes_a_checkpoint_path_and_refuses_bad_paths(tmp_path):
    _model, path = _export(tmp_path)
    engine = LLMEngine(path, max_num_seqs=2, max_num_batched_tokens=16, page_size=8, num_pages=8, warmup=False)
    assert engine.tokenizer is None
    with pytest.raises(ValueError, match="text prompts need a tokenizer"):
        engine.add_request("t", "hello", SamplingParams())
    with pytest.raises(ValueError, match="not a Hugging Face checkpoint"):
        LLMEngine(str(tmp_path), warmup=False)  # a directory without config.json
    with pytest.raises(ValueError, match="no such checkpoint directory"):
        LLMEngine(str(tmp_path / "nowhere" / "model"), warmup=False)
    os.remove(os.path.join(path, "model.safetensors"))
    with pytest.raises(ValueError, match=r"no model\.safetensors or model\.safetensors\.index\.json"):
        LLMEngine(path, warmup=False)
