"""Model configuration of the Llama family, and the named shapes cbjax ships."""

import dataclasses

from cbjax.config.model import DTYPES


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    head_dim: int | None = None  # None: hidden_size // num_heads
    rope_theta: float = 10000.0
    # Hashable rope scaling: (("rope_type", "llama3"), ("factor", 8.0), ...) or None. See rope.py.
    rope_scaling: tuple[tuple[str, object], ...] | None = None
    rms_norm_eps: float = 1e-5
    qkv_bias: bool = False  # Qwen2
    qk_norm: bool = False  # Qwen3: RMSNorm on each head's q and k before RoPE
    tie_word_embeddings: bool = False
    sliding_window: int | None = None  # Mistral
    max_position_embeddings: int = 2048
    initializer_range: float = 0.02  # std of the random init
    bos_token_id: int | None = 1
    eos_token_id: int | None = 2
    # More ids that end a sequence (HF checkpoints may list several eos ids, e.g. Llama-3 instruct); stop on any.
    extra_eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    dtype: str = "float32"  # parameters and activations; softmax and norms always run in float32
    # The linear layers' weights and matmul inputs (None: dtype). Accumulation is float32 either way. "bfloat16"
    # with float32 activations runs the matmuls ~1.5x faster on CPUs with AMX / AVX512-BF16 (docs/benchmarks.md),
    # at bf16's rounding of weights and matmul inputs; the embedding and a tied LM head stay in `dtype`.
    matmul_dtype: str | None = None

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        for name in ("dtype", "matmul_dtype"):
            value = getattr(self, name)
            if value not in DTYPES and not (name == "matmul_dtype" and value is None):
                raise ValueError(f"{name} must be one of {DTYPES}, got {value!r}")

    @property
    def dim_per_head(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_heads

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)

    def num_params(self) -> int:
        D, H, N, K, F, V = (
            self.hidden_size,
            self.dim_per_head,
            self.num_heads,
            self.num_kv_heads,
            self.intermediate_size,
            self.vocab_size,
        )
        attn = D * N * H + 2 * D * K * H + N * H * D + (N * H + 2 * K * H if self.qkv_bias else 0)
        per_layer = attn + 3 * D * F + 2 * D + (2 * H if self.qk_norm else 0)
        return V * D * (1 if self.tie_word_embeddings else 2) + self.num_layers * per_layer + D


NAMED_CONFIGS: dict[str, ModelConfig] = {
    # The shapes of the peer benchmarks (../shared/peers): random-init Llamas.
    "llama-tiny": ModelConfig(
        vocab_size=32000, hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=2, intermediate_size=688
    ),
    "llama-small": ModelConfig(
        vocab_size=32000, hidden_size=1024, num_layers=8, num_heads=16, num_kv_heads=4, intermediate_size=2816
    ),
    # Llama-2-7B's shapes, for the simulator only (cbjax.sim's roofline; docs/sim.md): never built as weights here.
    "llama-7b": ModelConfig(
        vocab_size=32000,
        hidden_size=4096,
        num_layers=32,
        num_heads=32,
        num_kv_heads=32,
        intermediate_size=11008,
        max_position_embeddings=4096,
        dtype="bfloat16",
    ),
    # For tests: small enough to compile and run in seconds; a wide init so greedy argmax has clear margins.
    "test-tiny": ModelConfig(
        vocab_size=512,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=128,
        initializer_range=0.2,
        max_position_embeddings=1024,
    ),
}


# llama-tiny with Mistral's sliding-window attention (window 128): the sliding-window experiments.
NAMED_CONFIGS["mistral-tiny"] = NAMED_CONFIGS["llama-tiny"].replace(sliding_window=128)


def get_model_config(name: str) -> ModelConfig:
    try:
        return NAMED_CONFIGS[name]
    except KeyError:
        raise ValueError(
            f"unknown model {name!r}; named configs: {sorted(NAMED_CONFIGS)} "
            "(or pass a path to a Hugging Face checkpoint directory)"
        ) from None
