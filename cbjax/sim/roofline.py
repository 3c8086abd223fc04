"""RooflineCost: what a step would take on a named accelerator, from the model's FLOPs and bytes. A prediction
from data-sheet peaks, never a measurement.

    time = max(FLOPs / (peak FLOP/s * flops_efficiency), bytes / (HBM bandwidth * bandwidth_efficiency))
           + overhead_s + swap bytes / host-link bandwidth

FLOPs:  2 * padded tokens * (matmul parameters per layer) * layers (the engine pads a step to its token bucket)
        + 4 * (query, key) pairs * heads * head_dim * layers (QK^T and PV)
        + 2 * hidden * vocab per sampling sequence (the LM head runs only on each sequence's last token)
bytes:  the weights once per step (every layer's matmuls and the LM head)
        + the KV of every context token read, and of every new token written
        + each page copied on write (core/sequence_group.py) read and written once
        + activations: per padded token and layer, the hidden state, q/k/v, the attention output and the MLP's
          intermediates, each written and read once
Memory: `kv_pages` gives the KV pages that fit in HBM * memory_utilization after the weights.

Peaks, from the vendors' data sheets (dense, no sparsity):
- NVIDIA H100 SXM: 989 TFLOP/s bf16, 3.35 TB/s HBM3, 80 GB ("NVIDIA H100 Tensor Core GPU Datasheet").
- NVIDIA H200 SXM: 989 TFLOP/s bf16, 4.8 TB/s HBM3e, 141 GB ("NVIDIA H200 Tensor Core GPU Datasheet").
- Google TPU v5e: 197 TFLOP/s bf16, 819 GB/s HBM2, 16 GB per chip (Google Cloud TPU documentation, "TPU v5e").
- Google TPU v6e (Trillium): 918 TFLOP/s bf16, 1640 GB/s HBM, 32 GB per chip (Google Cloud TPU documentation,
  "TPU v6e").
Host links (swaps): PCIe Gen5 x16 at 64 GB/s per direction for the NVIDIA parts (their data sheets give 128 GB/s
both ways); the TPU hosts' per-chip link is not in the data sheets: 32 GB/s (PCIe Gen4 x16) is an assumption.

Assumptions (set them per profile): efficiencies 1.0 (the pure roofline: a lower bound on time; real kernels reach
perhaps 50-80% of either peak), overhead_s = 1 ms per step (launch and host work not hidden by async
scheduling), `num_chips` chips in tensor parallel with free communication (optimistic).
"""

import dataclasses

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1}


@dataclasses.dataclass(frozen=True)
class Accelerator:
    name: str
    peak_flops: float  # bf16 dense FLOP/s
    hbm_bandwidth: float  # bytes/s
    hbm_bytes: float
    host_bandwidth: float  # bytes/s per direction (swaps)
    source: str


ACCELERATORS = {
    a.name: a
    for a in (
        Accelerator("h100", 989e12, 3.35e12, 80e9, 64e9, "NVIDIA H100 Tensor Core GPU Datasheet (SXM)"),
        Accelerator("h200", 989e12, 4.8e12, 141e9, 64e9, "NVIDIA H200 Tensor Core GPU Datasheet (SXM)"),
        Accelerator("tpu-v5e", 197e12, 819e9, 16e9, 32e9, "Google Cloud TPU documentation: TPU v5e"),
        Accelerator("tpu-v6e", 918e12, 1640e9, 32e9, 32e9, "Google Cloud TPU documentation: TPU v6e"),
    )
}

SHAPE_FIELDS = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size")


def model_shape(mcfg, kv_cache_dtype: str = "auto") -> dict:
    """The numbers of a ModelConfig (or any object with its fields) the roofline needs; `kv_cache_dtype` is the
    engine option ("auto": the model's dtype; "int8": one byte per value plus a float32 scale per token and kv
    head, kernels_pallas/kv_quant.py)."""
    shape = {k: int(getattr(mcfg, k)) for k in SHAPE_FIELDS}
    shape["head_dim"] = int(mcfg.dim_per_head)
    shape["dtype"] = str(mcfg.matmul_dtype or mcfg.dtype) if hasattr(mcfg, "matmul_dtype") else str(mcfg.dtype)
    shape["kv_dtype"] = str(mcfg.dtype) if kv_cache_dtype in (None, "auto") else kv_cache_dtype
    return shape


class RooflineCost:
    kind = "roofline"

    def __init__(
        self,
        shape: dict,
        accelerator: str,
        *,
        num_chips: int = 1,
        flops_efficiency: float = 1.0,
        bandwidth_efficiency: float = 1.0,
        overhead_s: float = 1e-3,
        memory_utilization: float = 0.9,
    ):
        if accelerator not in ACCELERATORS:
            raise ValueError(f"unknown accelerator {accelerator!r}; known: {sorted(ACCELERATORS)}")
        if num_chips < 1 or not 0 < flops_efficiency <= 1 or not 0 < bandwidth_efficiency <= 1 or overhead_s < 0:
            raise ValueError("RooflineCost needs num_chips >= 1, efficiencies in (0, 1] and overhead_s >= 0")
        self.shape = dict(shape)
        self.accelerator = ACCELERATORS[accelerator]
        self.num_chips = int(num_chips)
        self.flops_efficiency = float(flops_efficiency)
        self.bandwidth_efficiency = float(bandwidth_efficiency)
        self.overhead_s = float(overhead_s)
        self.memory_utilization = float(memory_utilization)
        s = self.shape
        D, L, N, K, H, F, V = (s[k] for k in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                                            "intermediate_size", "vocab_size"))  # fmt: skip
        w = DTYPE_BYTES[s["dtype"]]
        self.layer_params = D * N * H + 2 * D * K * H + N * H * D + 3 * D * F
        self.weight_bytes = (L * self.layer_params + 2 * V * D) * w  # LM head and embedding table held in HBM
        self.step_weight_bytes = (L * self.layer_params + V * D) * w  # read each step (embedding rows: negligible)
        kv_scale = 4 if s["kv_dtype"] == "int8" else 0  # int8 pages carry a float32 scale per token and kv head
        self.kv_bytes_per_token = 2 * L * K * (H * DTYPE_BYTES[s["kv_dtype"]] + kv_scale)
        self.act_bytes_per_token = 2 * L * w * (4 * D + (N + 2 * K) * H + N * H + 3 * F)
        self.attn_flops_per_pair = 4 * N * H * L
        self.head_flops_per_seq = 2 * D * V
        a, n = self.accelerator, self.num_chips
        self.flops_per_s = a.peak_flops * n * self.flops_efficiency
        self.bytes_per_s = a.hbm_bandwidth * n * self.bandwidth_efficiency

    @classmethod
    def for_model(cls, mcfg, accelerator: str, kv_cache_dtype: str = "auto", **options) -> "RooflineCost":
        return cls(model_shape(mcfg, kv_cache_dtype), accelerator, **options)

    def kv_pages(self, page_size: int) -> int:
        """KV pages that fit in HBM * memory_utilization once the weights are in."""
        free = self.accelerator.hbm_bytes * self.num_chips * self.memory_utilization - self.weight_bytes
        return max(0, int(free // (page_size * self.kv_bytes_per_token)))

    def step_time(self, f) -> float:
        swap = f.swap_bytes / self.accelerator.host_bandwidth
        if f.padded_tokens == 0:
            return self.overhead_s + swap
        flops = (
            2 * f.padded_tokens * self.layer_params * self.shape["num_layers"]
            + self.attn_flops_per_pair * f.attention_pairs
            + self.head_flops_per_seq * f.num_sampling_seqs
        )
        nbytes = (
            self.step_weight_bytes
            + self.kv_bytes_per_token * (f.sum_context + f.num_tokens)
            + self.act_bytes_per_token * f.padded_tokens
            + 2 * f.copy_bytes  # copy-on-write: each copied page is read and written once
        )
        return max(flops / self.flops_per_s, nbytes / self.bytes_per_s) + self.overhead_s + swap

    def to_dict(self) -> dict:
        return {
            "kind": self.kind,
            "prediction": "roofline from data-sheet peaks, not a measurement",
            "accelerator": self.accelerator.name,
            "source": self.accelerator.source,
            "shape": self.shape,
            "num_chips": self.num_chips,
            "flops_efficiency": self.flops_efficiency,
            "bandwidth_efficiency": self.bandwidth_efficiency,
            "overhead_s": self.overhead_s,
            "memory_utilization": self.memory_utilization,
        }

    @classmethod
    def from_dict(cls, d: dict) -> "RooflineCost":
        keys = ("num_chips", "flops_efficiency", "bandwidth_efficiency", "overhead_s", "memory_utilization")
        return cls(d["shape"], d["accelerator"], **{k: d[k] for k in keys if k in d})
