"""What `model=` names: a packaged checkpoint (cbjax/assets/<name>), a Hugging Face checkpoint directory, or a
named random-init config (cbjax.model.config.NAMED_CONFIGS). Nothing is ever downloaded."""

import os

from cbjax.model.config import ModelConfig, get_model_config
from cbjax.model.hf_loader import is_hf_checkpoint, read_hf_config

ASSETS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets")
# Trained by experiments/train_tiny.py on the Python standard library's sources; see docs/models.md.
DEFAULT_MODEL = "tinypy"
DRAFT_MODEL = "tinypy-draft"
# The packaged models are a few million parameters, meant for CPUs and tests: float32 keeps their outputs free of
# bf16 rounding, and XLA:CPU runs them faster in f32 (3.6k vs 3.1k greedy tokens/s for 8 sequences of tinypy).
# Their files store bf16 to stay small.
PACKAGED_DTYPE = "float32"


def packaged_models() -> list[str]:
    if not os.path.isdir(ASSETS_DIR):
        return []
    return sorted(n for n in os.listdir(ASSETS_DIR) if is_hf_checkpoint(os.path.join(ASSETS_DIR, n)))


def packaged_model_path(name: str = DEFAULT_MODEL) -> str:
    path = os.path.join(ASSETS_DIR, name)
    if not is_hf_checkpoint(path):
        raise ValueError(f"packaged model {name!r} not found in {ASSETS_DIR} (have: {packaged_models()})")
    return path


def resolve_checkpoint(model) -> tuple[str, str | None] | None:
    """(checkpoint directory, default dtype) for `model`, or None when it is not a checkpoint (a named config).

    None -> the packaged default model; a packaged model's name -> its directory; a directory with config.json ->
    itself (dtype: the checkpoint's own).
    """
    if model is None:
        return packaged_model_path(DEFAULT_MODEL), PACKAGED_DTYPE
    if not isinstance(model, (str, os.PathLike)):
        return None
    if isinstance(model, str) and model in packaged_models():
        return packaged_model_path(model), PACKAGED_DTYPE
    if is_hf_checkpoint(model):
        return os.fspath(model), None
    if os.path.isdir(model):
        raise ValueError(f"{model}: a directory without config.json is not a Hugging Face checkpoint")
    if os.sep in os.fspath(model):  # meant as a path, not a config name
        raise ValueError(f"{model}: no such checkpoint directory")
    return None


def model_config_of(model) -> ModelConfig:
    """The ModelConfig `model=` names (a checkpoint's config.json, or a named config), without loading weights:
    to check a run's options before anything is built."""
    checkpoint = resolve_checkpoint(model)
    if checkpoint is not None:
        return read_hf_config(checkpoint[0], checkpoint[1])
    if not isinstance(model, str):
        raise ValueError(f"model must be a name or a checkpoint directory, got {model!r}")
    return get_model_config(model)
