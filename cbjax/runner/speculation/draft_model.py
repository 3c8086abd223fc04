"""The draft model of speculative decoding (speculative_config method "draft"): checking it against the target,
before anything is loaded or compiled, and loading it.

A draft proposes token ids that the target verifies, so both must speak the same ids: the same vocabulary size
and, where both have a tokenizer, the same token -> id map (a draft with another tokenizer is a ValueError, not
a silent 0% acceptance). The draft runs in the target's engine on the target's page tables
(cbjax/runner/speculation/draft_runner.py), so its own max_position_embeddings must cover the engine's max_model_len.
"""

from cbjax.model.config import ModelConfig
from cbjax.model.hf_loader import load_hf_model
from cbjax.model.llama import Llama, init_model
from cbjax.model.registry import model_config_of, resolve_checkpoint
from cbjax.model.tokenizer import Tokenizer


def _config_and_tokenizer(model) -> "tuple[ModelConfig, Tokenizer | None]":
    if isinstance(model, Llama):
        return model.cfg, None
    if isinstance(model, ModelConfig):
        return model, None
    checkpoint = resolve_checkpoint(model)
    return model_config_of(model), (None if checkpoint is None else Tokenizer.from_dir(checkpoint[0]))


def draft_config(draft) -> ModelConfig:
    return _config_and_tokenizer(draft)[0]


def check_draft_model(target, draft, max_model_len: int | None) -> None:
    """ValueError unless `draft` can draft for `target` (each a `model=` value: a name, a checkpoint directory, a
    ModelConfig or a built Llama). `max_model_len`: the engine's (None: the target's own limit)."""
    where = "speculative_config.draft_model"
    target_cfg, target_tok = _config_and_tokenizer(target)
    try:
        draft_cfg, draft_tok = _config_and_tokenizer(draft)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    if draft_cfg.vocab_size != target_cfg.vocab_size:
        raise ValueError(
            f"{where}: the draft's vocabulary ({draft_cfg.vocab_size} tokens) differs from the target's "
            f"({target_cfg.vocab_size}); a draft must use the target's token ids"
        )
    if target_tok is not None and draft_tok is not None and target_tok.vocab() != draft_tok.vocab():
        raise ValueError(f"{where}: the draft's tokenizer differs from the target's (another token -> id map)")
    limit = max_model_len or target_cfg.max_position_embeddings
    if draft_cfg.max_position_embeddings < limit:
        raise ValueError(
            f"{where}: the draft's max_position_embeddings ({draft_cfg.max_position_embeddings}) is below the "
            f"engine's max_model_len ({limit})"
        )


def load_draft_model(draft, dtype: str | None, matmul_dtype: str | None) -> Llama:
    """The draft as a Llama: a built one as is; a checkpoint with its weights (packaged: float32, as the target);
    a named config randomly initialised (seed 1: not the target's weights)."""
    if isinstance(draft, Llama):
        return draft
    checkpoint = resolve_checkpoint(draft)
    if checkpoint is not None:
        path, default_dtype = checkpoint
        return load_hf_model(path, dtype or default_dtype, matmul_dtype)
    cfg = draft if isinstance(draft, ModelConfig) else model_config_of(draft)
    overrides = {k: v for k, v in dict(dtype=dtype, matmul_dtype=matmul_dtype).items() if v is not None}
    return init_model(cfg.replace(**overrides), seed=1)
