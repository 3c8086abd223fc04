"""Hugging Face checkpoints <-> the cbjax Llama: config.json + safetensors (single file or sharded).

Supported architectures: LlamaForCausalLM (incl. Llama-3 rope scaling), MistralForCausalLM (sliding window),
Qwen2ForCausalLM (q/k/v bias, tied embeddings), Qwen3ForCausalLM (q/k RMSNorm, explicit head_dim). Anything the
cbjax decoder would compute differently from transformers (another activation, an o_proj or MLP bias, per-layer
sliding windows, yarn/dynamic rope) is refused with a ValueError instead of loading into wrong numbers.

Tensors are read with the `safetensors` numpy API, checked (present, shape, floating dtype, finite), cast to the
requested dtype and set into an abstract NNX model, so a checkpoint is never initialised randomly first.
"""

import json
import os

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from cbjax.model.config import ModelConfig
from cbjax.model.llama import Llama, abstract_model, build_model

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
_NP_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
# Tensors some checkpoints carry that hold nothing the model needs (old Llama exports saved the RoPE table).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def is_hf_checkpoint(path) -> bool:
    return isinstance(path, (str, os.PathLike)) and os.path.isfile(os.path.join(path, "config.json"))


def read_json(path: str, required: bool = True) -> dict | None:
    if not os.path.isfile(path):
        if required:
            raise ValueError(f"{path}: file not found")
        return None
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _first(ids):
    """HF token-id fields may be an int, a list of ints, or null."""
    if isinstance(ids, (list, tuple)):
        return (int(ids[0]) if ids else None), tuple(int(i) for i in ids[1:])
    return (None if ids is None else int(ids)), ()


def _rope(hf: dict, where: str) -> tuple[float, tuple | None]:
    """rope_theta and the hashable rope_scaling tuple, from either the transformers-5 `rope_parameters` dict or the
    older `rope_theta` + `rope_scaling` fields."""
    params = dict(hf.get("rope_parameters") or {})
    params.update(hf.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", hf.get("rope_theta", 10000.0)))
    kind = params.pop("rope_type", params.pop("type", "default"))
    if kind == "default":
        return theta, None
    if kind not in ("linear", "llama3"):
        raise ValueError(f"{where}: unsupported rope scaling type {kind!r} (supported: default, linear, llama3)")
    # attention_factor etc. would scale logits; only the keys rope.py reads are accepted, so nothing is dropped.
    known = {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}
    extra = sorted(set(params) - known)
    if extra:
        raise ValueError(f"{where}: unsupported rope scaling keys {extra} for rope_type {kind!r}")
    return theta, (("rope_type", kind),) + tuple(sorted((k, float(v)) for k, v in params.items()))


def _sliding_window(hf: dict, arch: str, where: str) -> int | None:
    window = hf.get("sliding_window")
    if arch == "MistralForCausalLM":
        return int(window) if window else None
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        if not hf.get("use_sliding_window", False) or not window:
            return None
        # Qwen applies the window only to some layers (layer_types / max_window_layers); one window for every
        # layer is all the cbjax decoder has, so anything mixed is refused.
        n = hf["num_hidden_layers"]
        types = hf.get("layer_types") or [
            "sliding_attention" if i >= hf.get("max_window_layers", n) else "full_attention" for i in range(n)
        ]
        if all(t == "sliding_attention" for t in types):
            return int(window)
        if all(t == "full_attention" for t in types):
            return None
        raise ValueError(f"{where}: sliding window on only some layers ({types}) is not supported")
    return None


def model_config_from_hf(
    hf: dict, generation: dict | None = None, *, dtype: str | None = None, where: str = "config.json"
) -> ModelConfig:
    """ModelConfig from a parsed config.json (and generation_config.json, whose eos/bos ids take precedence)."""
    archs = hf.get("architectures") or []
    arch = archs[0] if archs else None
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{where}: unsupported architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    missing = [k for k in required if k not in hf]
    if missing:
        raise ValueError(f"{where}: missing fields {missing}")
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{where}: unsupported hidden_act {act!r} (the cbjax decoder's MLP is SwiGLU with silu)")
    if hf.get("mlp_bias"):
        raise ValueError(f"{where}: mlp_bias=true is not supported")
    # Llama/Qwen3 `attention_bias` puts a bias on o_proj too, which the decoder has no parameter for; Qwen2 always
    # has q/k/v biases and none on o_proj.
    if hf.get("attention_bias") and arch != "Qwen2ForCausalLM":
        raise ValueError(f"{where}: attention_bias=true (a bias on o_proj) is not supported for {arch}")
    theta, scaling = _rope(hf, where)
    gen = generation or {}
    eos, extra_eos = _first(gen["eos_token_id"] if "eos_token_id" in gen else hf.get("eos_token_id"))
    bos, _ = _first(gen["bos_token_id"] if "bos_token_id" in gen else hf.get("bos_token_id"))
    pad, _ = _first(gen["pad_token_id"] if gen.get("pad_token_id") is not None else hf.get("pad_token_id"))
    if dtype is None:
        dtype = hf.get("dtype", hf.get("torch_dtype"))
        dtype = dtype if dtype in _NP_DTYPES else "float32"
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim")
    if head_dim and int(head_dim) == int(hf["hidden_size"]) // int(heads):
        head_dim = None  # the default, spelled as ModelConfig spells it, so configs compare equal
    try:
        return ModelConfig(
            vocab_size=int(hf["vocab_size"]),
            hidden_size=int(hf["hidden_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=int(heads),
            num_kv_heads=int(hf.get("num_key_value_heads") or heads),
            intermediate_size=int(hf["intermediate_size"]),
            head_dim=int(head_dim) if head_dim else None,
            rope_theta=theta,
            rope_scaling=scaling,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            qkv_bias=arch == "Qwen2ForCausalLM",
            qk_norm=arch == "Qwen3ForCausalLM",
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            sliding_window=_sliding_window(hf, arch, where),
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
            initializer_range=float(hf.get("initializer_range", 0.02)),
            bos_token_id=bos,
            eos_token_id=eos,
            extra_eos_token_ids=extra_eos,
            pad_token_id=pad,
            dtype=dtype,
        )
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def hf_tensor_names(cfg: ModelConfig) -> dict[tuple, tuple[tuple[str, ...], bool]]:
    """NNX parameter path -> (HF tensor names, transpose). nnx.Linear kernels are [in, out], HF weights [out, in].

    A parameter with several names is their concatenation along HF's output axis: the fused q | k | v projection
    (and its biases) and the fused gate | up projection (see cbjax/model/llama.py)."""
    names = {
        ("embed", "embedding"): (("model.embed_tokens.weight",), False),
        ("norm", "weight"): (("model.norm.weight",), False),
    }
    if not cfg.tie_word_embeddings:
        names[("lm_head", "kernel")] = (("lm_head.weight",), True)
    for i in range(cfg.num_layers):
        hf = f"model.layers.{i}."
        qkv = tuple(f"{hf}self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj"))
        names[("layers", i, "input_norm", "weight")] = ((hf + "input_layernorm.weight",), False)
        names[("layers", i, "post_attn_norm", "weight")] = ((hf + "post_attention_layernorm.weight",), False)
        names[("layers", i, "attn", "qkv_proj", "kernel")] = (tuple(n + ".weight" for n in qkv), True)
        names[("layers", i, "attn", "o_proj", "kernel")] = ((f"{hf}self_attn.o_proj.weight",), True)
        if cfg.qkv_bias:
            names[("layers", i, "attn", "qkv_proj", "bias")] = (tuple(n + ".bias" for n in qkv), False)
        if cfg.qk_norm:
            for p in ("q_norm", "k_norm"):
                names[("layers", i, "attn", p, "weight")] = ((f"{hf}self_attn.{p}.weight",), False)
        gate_up = (f"{hf}mlp.gate_proj.weight", f"{hf}mlp.up_proj.weight")
        names[("layers", i, "mlp", "gate_up_proj", "kernel")] = (gate_up, True)
        names[("layers", i, "mlp", "down_proj", "kernel")] = ((f"{hf}mlp.down_proj.weight",), True)
    return names


def fused_part_sizes(cfg: ModelConfig, names: tuple[str, ...]) -> list[int]:
    """The output-axis size of each HF tensor that makes up one parameter, in order."""
    if len(names) == 1:
        return []
    if len(names) == 3:  # q | k | v
        H = cfg.dim_per_head
        return [cfg.num_heads * H, cfg.num_kv_heads * H, cfg.num_kv_heads * H]
    return [cfg.intermediate_size] * 2  # gate | up


class _SafetensorsFiles:
    """The checkpoint's tensors by name, over model.safetensors or the shards named by its index."""

    def __init__(self, path: str):
        self._handles: dict[str, object] = {}
        index = os.path.join(path, "model.safetensors.index.json")
        single = os.path.join(path, "model.safetensors")
        if os.path.isfile(index):
            weight_map = read_json(index).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise ValueError(f"{index}: no weight_map")
            self.file_of = {name: os.path.join(path, shard) for name, shard in weight_map.items()}
        elif os.path.isfile(single):
            self.file_of = dict.fromkeys(self._open(single).keys(), single)
        else:
            raise ValueError(f"{path}: no model.safetensors or model.safetensors.index.json")

    def _open(self, file: str):
        if file not in self._handles:
            if not os.path.isfile(file):
                raise ValueError(f"{file}: shard not found (named by the checkpoint's index)")
            try:
                self._handles[file] = safe_open(file, framework="np")
            except (SafetensorError, OSError) as e:
                raise ValueError(f"{file}: not a readable safetensors file ({e})") from None
        return self._handles[file]

    def names(self) -> set[str]:
        return set(self.file_of)

    def get(self, name: str) -> tuple[np.ndarray, str]:
        file = self.file_of.get(name)
        if file is None:
            raise ValueError(f"{self._where()}: tensor {name!r} is missing")
        try:
            arr = self._open(file).get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise ValueError(f"{file}: tensor {name!r} could not be read ({e})") from None
        return arr, file

    def _where(self) -> str:
        files = sorted(set(self.file_of.values()))
        return files[0] if len(files) == 1 else os.path.join(os.path.dirname(files[0]), "model.safetensors.index.json")


def load_hf_params(path: str, cfg: ModelConfig) -> dict[tuple, np.ndarray]:
    """Every parameter of `cfg`'s model, read from the checkpoint at `path`, in the dtype the model gives it (host
    arrays)."""
    files = _SafetensorsFiles(path)
    specs = {p: v.get_value() for p, v in nnx.to_flat_state(nnx.state(abstract_model(cfg), nnx.Param))}
    names = hf_tensor_names(cfg)
    if set(specs) != set(names):  # a decoder change the mapping does not know about: fail loudly, not silently
        raise AssertionError(f"parameter map out of date: {sorted(set(specs) ^ set(names))}")
    wanted = {hf for hfs, _ in names.values() for hf in hfs}
    if cfg.tie_word_embeddings:
        wanted.add("lm_head.weight")  # some tied checkpoints still store the (identical) head; it is not used
    unexpected = sorted(n for n in files.names() - wanted if not n.endswith(_IGNORED_SUFFIXES))
    if unexpected:
        raise ValueError(
            f"{files._where()}: unexpected tensors for this config (another architecture?): {unexpected[:5]}"
        )
    out = {}
    for nnx_path, (hf_names, transpose) in names.items():
        spec = specs[nnx_path]
        shape = tuple(spec.shape)[::-1] if transpose else tuple(spec.shape)  # in HF's [out, in] order
        parts = []
        for name, size in zip(hf_names, fused_part_sizes(cfg, hf_names) or [shape[0]]):
            arr, file = files.get(name)
            want = (size, *shape[1:])
            if tuple(arr.shape) != want:
                raise ValueError(
                    f"{file}: tensor {name!r} has shape {tuple(arr.shape)}, expected {want} from config.json"
                )
            if arr.dtype not in (np.float32, np.float16, ml_dtypes.bfloat16):
                raise ValueError(
                    f"{file}: tensor {name!r} has dtype {arr.dtype}, expected float32, float16 or bfloat16"
                )
            # A NaN/inf weight would not fail anywhere later: it would just make every logit NaN and argmax 0.
            if not np.isfinite(arr.astype(np.float32)).all():
                raise ValueError(f"{file}: tensor {name!r} has non-finite values (corrupt checkpoint?)")
            parts.append(arr)
        arr = np.concatenate(parts, axis=0) if len(parts) > 1 else parts[0]
        out[nnx_path] = (arr.T if transpose else arr).astype(spec.dtype)  # the model's dtype for it
    return out


def read_hf_config(path: str, dtype: str | None = None) -> ModelConfig:
    hf = read_json(os.path.join(path, "config.json"))
    gen = read_json(os.path.join(path, "generation_config.json"), required=False)
    return model_config_from_hf(hf, gen, dtype=dtype, where=os.path.join(path, "config.json"))


def load_hf_model(path: str, dtype: str | None = None, matmul_dtype: str | None = None, on_host: bool = False) -> Llama:
    """A cbjax Llama with the weights of the Hugging Face checkpoint directory `path`, in `dtype` (default: the
    checkpoint's own dtype; the linear layers in `matmul_dtype` if given, see ModelConfig). `on_host`: the weights
    stay numpy arrays until a runner places them (shard by shard under tensor parallelism)."""
    cfg = read_hf_config(path, dtype)
    if matmul_dtype is not None:
        cfg = cfg.replace(matmul_dtype=matmul_dtype)
    params = load_hf_params(path, cfg)
    return build_model(cfg, lambda p, spec: params[p], on_host)


def hf_config_dict(cfg: ModelConfig, dtype: str = "bfloat16") -> dict:
    """config.json for a cbjax model, as LlamaForCausalLM (or Qwen2/Qwen3 when it has their features)."""
    if cfg.qkv_bias and cfg.qk_norm:
        raise ValueError("no Hugging Face architecture has both qkv bias and q/k norm")
    arch, model_type = (
        ("Qwen2ForCausalLM", "qwen2")
        if cfg.qkv_bias
        else (
            ("Qwen3ForCausalLM", "qwen3")
            if cfg.qk_norm
            else (("MistralForCausalLM", "mistral") if cfg.sliding_window else ("LlamaForCausalLM", "llama"))
        )
    )
    rope = {"rope_theta": cfg.rope_theta, "rope_type": "default"}
    rope.update(dict(cfg.rope_scaling or {}))
    return {
        "architectures": [arch],
        "model_type": model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.dim_per_head,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        # Both spellings, so transformers 4.x (rope_theta/rope_scaling) and 5.x (rope_parameters) read it.
        "rope_theta": cfg.rope_theta,
        "rope_scaling": dict(cfg.rope_scaling) if cfg.rope_scaling else None,
        "rope_parameters": rope,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "sliding_window": cfg.sliding_window,
        "initializer_range": cfg.initializer_range,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": _eos_field(cfg),
        "pad_token_id": cfg.pad_token_id,
        "dtype": dtype,
        "torch_dtype": dtype,
        "use_cache": True,
    }


def _eos_field(cfg: ModelConfig):
    return [cfg.eos_token_id, *cfg.extra_eos_token_ids] if cfg.extra_eos_token_ids else cfg.eos_token_id


def save_hf_model(model: Llama, path: str, dtype: str = "bfloat16") -> None:
    """Write config.json, generation_config.json and model.safetensors (weights in `dtype`) so that both
    `load_hf_model` and transformers' `AutoModelForCausalLM.from_pretrained` read them."""
    cfg = model.cfg
    os.makedirs(path, exist_ok=True)
    tensors = {}
    names = hf_tensor_names(cfg)
    for p, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        hf_names, transpose = names[p]
        arr = np.asarray(var.get_value().astype(jnp.float32))
        arr = arr.T if transpose else arr
        sizes = fused_part_sizes(cfg, hf_names) or [arr.shape[0]]
        for name, part in zip(hf_names, np.split(arr, np.cumsum(sizes)[:-1], axis=0)):
            tensors[name] = np.ascontiguousarray(part).astype(_NP_DTYPES[dtype])
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
        json.dump(hf_config_dict(cfg, dtype), f, indent=2)
    gen = {"bos_token_id": cfg.bos_token_id, "eos_token_id": _eos_field(cfg), "pad_token_id": cfg.pad_token_id}
    with open(os.path.join(path, "generation_config.json"), "w", encoding="utf-8") as f:
        json.dump(gen, f, indent=2)
