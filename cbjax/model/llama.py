"""A Llama-family decoder in Flax NNX: RMSNorm, RoPE, grouped-query attention, SwiGLU MLP.

Two forwards share the weights:
- `__call__`: the serving forward over a flat ragged batch of T tokens that writes the new K/V into the paged
  cache and reads it through `kernels_pallas.ragged_attention` (backend switch).
- `forward_full`: a plain full-sequence causal forward with no cache, the oracle the engine is tested against.
"""

import typing
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from cbjax.model.config import ModelConfig
from cbjax.model.rope import apply_rope, inv_frequencies
from kernels_pallas import kv_quant, kv_write, ragged_attention
from kernels_pallas.choices import KV_CACHE_DTYPES


class AttentionMetadata(typing.NamedTuple):
    """Per-step int32 arrays (never static) describing the flat batch; see kernels_pallas/xla_attention.py."""

    slot_mapping: jax.Array  # [T] flat cache row (page * G + offset) where each token's K/V is written
    kv_lens: jax.Array  # [B] context length of each sequence after this step
    page_indices: jax.Array  # [B, W] page table
    cu_q_lens: jax.Array  # [B+1] token offsets of each sequence in the flat batch
    num_seqs: jax.Array  # [1]


def project(linear, x, valid_rows=None):
    """linear(x). `valid_rows` (int32 [1], traced): a padded batch's real rows, the leading ones; a linear that
    can skip the padding rows (PackedLinear: `skips_padding_rows`) is told, the others compute every row."""
    if valid_rows is not None and getattr(linear, "skips_padding_rows", False):
        return linear(x, valid_rows)
    return linear(x)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype):
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((dim,), dtype))

    def __call__(self, x):
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return (xf * self.weight[...].astype(jnp.float32)).astype(x.dtype)


def _linear(cfg: ModelConfig, din: int, dout: int, rngs: nnx.Rngs, bias: bool = False) -> nnx.Linear:
    dt = jnp.dtype(cfg.matmul_dtype or cfg.dtype)
    # Accumulate in float32 whatever the weights: on CPUs with AVX512-BF16 / AMX a bf16 x bf16 -> f32 matmul runs
    # 2-5x faster than f32, while bf16 -> bf16 falls off the fast path. The inputs are cast to `dt` at the dot.
    return nnx.Linear(
        din,
        dout,
        use_bias=bias,
        dtype=dt,
        param_dtype=dt,
        rngs=rngs,
        kernel_init=nnx.initializers.normal(cfg.initializer_range),
        preferred_element_type=jnp.float32,
    )


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        D, N, K, H = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.dim_per_head
        self.cfg = cfg
        # q, k and v come out of one [D, (N + 2K) H] matmul (HF's q_proj | k_proj | v_proj, concatenated on their
        # output axis by the loader): XLA:CPU runs independent matmuls of a step side by side on the cores, each
        # slower than alone, and one wide GEMM also loads the activations once (docs/benchmarks.md).
        self.qkv_proj = _linear(cfg, D, (N + 2 * K) * H, rngs, cfg.qkv_bias)
        self.o_proj = _linear(cfg, N * H, D, rngs)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(H, cfg.rms_norm_eps, jnp.dtype(cfg.dtype))
            self.k_norm = RMSNorm(H, cfg.rms_norm_eps, jnp.dtype(cfg.dtype))

    def _qkv(self, x, positions, valid_rows=None):
        cfg = self.cfg
        N, K, H = cfg.num_heads, cfg.num_kv_heads, cfg.dim_per_head
        q, k, v = jnp.split(project(self.qkv_proj, x, valid_rows), [N * H, (N + K) * H], axis=-1)
        q = q.reshape(*x.shape[:-1], N, H)
        k = k.reshape(*x.shape[:-1], K, H)
        v = v.reshape(*x.shape[:-1], K, H)
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        # Host-side numpy, folded into the compiled step as a constant.
        inv_freq = inv_frequencies(H, cfg.rope_theta, cfg.rope_scaling)
        return apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq), v

    def __call__(self, x, positions, cache: tuple, md: AttentionMetadata, backend: str, interpret: bool, mesh=None):
        """x [T, D] -> ([T, D], the layer's cache updated with this step's tokens). `cache`: (k_pages, v_pages)
        [K, P, G, H], or with an int8 cache (k_pages, v_pages, k_scales, v_scales), the scales [K, P, G, 1]
        (kernels_pallas/kv_quant.py). `mesh`: tensor parallelism (attention split by kv heads, see
        kernels_pallas.dispatch). The step's tokens are x's first md.cu_q_lens[-1] rows, the rest padding."""
        T = x.shape[0]
        valid_rows = md.cu_q_lens[-1:]
        q, k, v = self._qkv(x, positions, valid_rows)
        if len(cache) == 4:  # int8 pages: each new row is quantized once, here, with its own scale
            (k, k_scale), (v, v_scale) = kv_quant.quantize(k), kv_quant.quantize(v)
            rows = (k, v, k_scale, v_scale)
        else:
            rows = (k, v)
        # Write the new rows into each array (kv_write.py: in place); padding tokens write to the spare page.
        sharded = mesh is not None and mesh.size > 1
        cache = tuple(
            kv_write.write_rows(pages, new, md.slot_mapping, sharded=sharded) for pages, new in zip(cache, rows)
        )
        scales = dict(k_scales=cache[2], v_scales=cache[3]) if len(cache) == 4 else {}
        out = ragged_attention(
            q,
            cache[0],
            cache[1],
            md.kv_lens,
            md.page_indices,
            md.cu_q_lens,
            md.num_seqs,
            sliding_window=self.cfg.sliding_window,
            backend=backend,
            interpret=interpret,
            mesh=mesh,
            **scales,
        )
        return project(self.o_proj, out.reshape(T, -1), valid_rows), cache

    def full(self, x, positions, kv_round_trip: Callable | None = None):
        """Dense causal attention over x [B, S, D], no cache. `kv_round_trip`: what storing K and V [B, S, K, H] in
        a cache does to them, applied first (kv_quant.round_trip: the int8 cache, as the serving forward with
        kv_cache_dtype="int8" reads them back)."""
        cfg = self.cfg
        B, S, _ = x.shape
        N, K, H = cfg.num_heads, cfg.num_kv_heads, cfg.dim_per_head
        q, k, v = self._qkv(x, positions)
        if kv_round_trip is not None:
            k, v = kv_round_trip(k), kv_round_trip(v)
        q = q.astype(jnp.float32).reshape(B, S, K, N // K, H) * H**-0.5
        s = jnp.einsum("bskrh,btkh->bkrst", q, k.astype(jnp.float32))
        i, j = jnp.arange(S)[:, None], jnp.arange(S)[None, :]
        mask = j <= i
        if cfg.sliding_window is not None:
            mask &= j > i - cfg.sliding_window
        s = jnp.where(mask, s, -jnp.inf)
        p = jax.nn.softmax(s, axis=-1)
        out = jnp.einsum("bkrst,btkh->bskrh", p, v.astype(jnp.float32)).reshape(B, S, N * H)
        return self.o_proj(out.astype(x.dtype))


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        # gate | up as one [D, 2F] matmul, for the reason given at Attention.qkv_proj.
        self.gate_up_proj = _linear(cfg, cfg.hidden_size, 2 * cfg.intermediate_size, rngs)
        self.down_proj = _linear(cfg, cfg.intermediate_size, cfg.hidden_size, rngs)

    def __call__(self, x, valid_rows=None):
        """`valid_rows`: x's real rows, the leading ones (see `project`); None: all."""
        gate, up = jnp.split(project(self.gate_up_proj, x, valid_rows), 2, axis=-1)
        return project(self.down_proj, jax.nn.silu(gate) * up, valid_rows)


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        dt = jnp.dtype(cfg.dtype)
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dt)
        self.attn = Attention(cfg, rngs)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dt)
        self.mlp = MLP(cfg, rngs)


class Llama(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        dt = jnp.dtype(cfg.dtype)
        self.cfg = cfg
        self.embed = nnx.Embed(
            cfg.vocab_size,
            cfg.hidden_size,
            dtype=dt,
            param_dtype=dt,
            rngs=rngs,
            embedding_init=nnx.initializers.normal(cfg.initializer_range),
        )
        self.layers = nnx.List([DecoderLayer(cfg, rngs) for _ in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dt)
        if not cfg.tie_word_embeddings:
            self.lm_head = _linear(cfg, cfg.hidden_size, cfg.vocab_size, rngs)

    def __call__(
        self,
        tokens,
        positions,
        kv_caches,
        md: AttentionMetadata,
        backend: str = "xla",
        interpret: bool = False,
        mesh=None,
    ):
        """Serving forward: tokens, positions [T] -> final hidden states [T, D] and the updated caches."""
        x = self.embed(tokens)
        new_caches = []
        for layer, cache in zip(self.layers, kv_caches):
            h, cache = layer.attn(layer.input_norm(x), positions, cache, md, backend, interpret, mesh)
            x = x + h
            x = x + layer.mlp(layer.post_attn_norm(x), md.cu_q_lens[-1:])
            new_caches.append(cache)
        return self.norm(x), new_caches

    def logits(self, hidden, valid_rows=None):
        """hidden [..., D] -> float32 logits [..., V]. `valid_rows`: hidden's real rows, the leading ones (see
        `project`; the logits of the others may then be zeros); None: all."""
        if self.cfg.tie_word_embeddings:
            return self.embed.attend(hidden).astype(jnp.float32)
        return project(self.lm_head, hidden, valid_rows).astype(jnp.float32)

    @property
    def fuses_greedy_head(self) -> bool:
        """Whether `greedy_tokens` is available: an untied LM head that fuses its argmax (PackedLinear)."""
        return not self.cfg.tie_word_embeddings and getattr(self.lm_head, "fuses_argmax", False)

    def greedy_tokens(self, hidden, valid_rows=None):
        """hidden [..., D] -> int32 [...]: argmax of logits(hidden) (first index on ties, as the sampler's greedy
        pick), without materialising the [..., V] logits. Only where `fuses_greedy_head`."""
        return self.lm_head.argmax(hidden, valid_rows)

    def forward_full(self, tokens, kv_round_trip: Callable | None = None):
        """Oracle: tokens [B, S] -> logits [B, S, V] with plain causal attention and no cache. `kv_round_trip`:
        kv_quant.round_trip for the oracle of an int8 KV cache (see Attention.full)."""
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        x = self.embed(tokens)
        for layer in self.layers:
            x = x + layer.attn.full(layer.input_norm(x), positions, kv_round_trip)
            x = x + layer.mlp(layer.post_attn_norm(x))
        return self.logits(self.norm(x))


def abstract_model(cfg: ModelConfig) -> Llama:
    """The model's structure with shapes and dtypes only: nothing allocated, nothing initialised."""
    return nnx.eval_shape(lambda: Llama(cfg, nnx.Rngs(0)))


def build_model(
    cfg: ModelConfig, value_of: Callable[[tuple, jax.ShapeDtypeStruct], np.ndarray], on_host: bool = False
) -> Llama:
    """A model whose every parameter is `value_of(path, shape_and_dtype)` (host arrays, cast to the dtype), without
    running the model's own initialisers. `on_host`: keep them as numpy arrays, for a runner that places them shard
    by shard (tensor parallelism: no device ever holds a whole array it only needs a slice of)."""
    graphdef, state = nnx.split(abstract_model(cfg))
    for path, var in nnx.to_flat_state(state):
        spec = var.get_value()
        host = np.asarray(value_of(path, spec)).astype(spec.dtype)
        var.set_value(host if on_host else jnp.asarray(host))
    return nnx.merge(graphdef, state)


def init_model(cfg: ModelConfig, seed: int = 0, on_host: bool = False) -> Llama:
    """A randomly initialised model: kernels and embeddings ~ N(0, initializer_range), norms 1, biases 0.

    Drawn with numpy on the host: jax's initialisers compile a program per parameter shape (~2.5 s for
    llama-tiny, paid by every process), numpy draws its 19M parameters in ~0.3 s."""
    rng = np.random.default_rng(seed)

    def value_of(path, spec):
        if path[-1] in ("kernel", "embedding"):
            return rng.standard_normal(spec.shape, dtype=np.float32) * np.float32(cfg.initializer_range)
        return np.ones(spec.shape, np.float32) if path[-1] == "weight" else np.zeros(spec.shape, np.float32)

    return build_model(cfg, value_of, on_host)


def kv_cache_dtype(cfg: ModelConfig, kv_cache_dtype: str | None = "auto") -> jnp.dtype:
    """The dtype of the KV pages: the model's for "auto" (or None), else the one named (int8: kv_quant.py)."""
    if kv_cache_dtype not in (None, *KV_CACHE_DTYPES):
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
    return jnp.dtype(cfg.dtype if kv_cache_dtype in (None, "auto") else kv_cache_dtype)


def kv_cache_arrays(cfg: ModelConfig, num_pages: int, page_size: int, kv_cache_dtype_name: str | None = "auto"):
    """(shape, dtype) of each array of one layer's paged cache: K and V pages [K, num_pages, G, H], and for int8
    pages their float32 scales [K, num_pages, G, 1] (kernels_pallas/kv_quant.py)."""
    shape = (cfg.num_kv_heads, num_pages, page_size, cfg.dim_per_head)
    dt = kv_cache_dtype(cfg, kv_cache_dtype_name)
    arrays = [(shape, dt), (shape, dt)]
    if dt == jnp.int8:
        arrays += [(shape[:3] + (1,), jnp.dtype(jnp.float32))] * 2
    return arrays


def kv_cache_bytes_per_page(cfg: ModelConfig, page_size: int, kv_cache_dtype_name: str | None = "auto") -> int:
    """Bytes of one KV page over every layer: K and V, plus an int8 cache's float32 scale per token and kv head."""
    dt = kv_cache_dtype(cfg, kv_cache_dtype_name)
    per_token_and_head = cfg.dim_per_head * dt.itemsize + (4 if dt == jnp.int8 else 0)
    return 2 * cfg.num_layers * cfg.num_kv_heads * page_size * per_token_and_head
