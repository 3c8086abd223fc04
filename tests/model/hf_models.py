"""Tiny random Hugging Face checkpoints for the parity tests."""

import torch
import transformers

# Small shapes every architecture accepts; each test adds its own fields.
TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)


def random_hf_model(config_class: str, model_class: str, **config):
    """A transformers model of TINY shapes (overridden by `config`), eager attention, weights drawn widely.

    HF's init leaves biases at 0 and norm gains at 1, which would not test that they are loaded. Everything is
    randomised, and widely (std 0.2), so greedy argmaxes have clear margins over float32 rounding."""
    cfg = getattr(transformers, config_class)(**{**TINY, **config}, attn_implementation="eager")
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
    return model
