"""The model room: Llama-family decoder, configs, loaders."""

from cbjax.model.config import NAMED_CONFIGS, ModelConfig, get_model_config
from cbjax.model.llama import AttentionMetadata, Llama, init_model

__all__ = ["NAMED_CONFIGS", "AttentionMetadata", "Llama", "ModelConfig", "get_model_config", "init_model"]
