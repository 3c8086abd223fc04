"""What experiments/accelerator_check.py runs at each size: the kernel cases (shapes, dtypes, options and the batch
each runs on), the engine comparisons' models and workloads, the bandwidth cases and the throughput runs.

`small` is toy sizes for CPU (the kernels in interpret mode, seconds each; CI runs it); `full` is realistic sizes
for one TPU chip or GPU (an 8B-like attention, contexts to 4096). A case's mistakes raise when the plan is built,
on the CPU, not minutes into a device run.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class KernelCase:
    """One kernel call: the op, its shapes and options, and the batch it runs on."""

    name: str
    op: str  # "decode" (paged_attention) | "ragged" (ragged_paged_attention)
    kv_lens: tuple[int, ...]  # live sequences' context lengths (0: an empty decode slot)
    num_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: str  # q's dtype, and the pages' unless kv_int8
    kv_int8: bool = False
    sliding_window: int | None = None
    soft_cap: float | None = None
    q_lens: tuple[int, ...] = ()  # ragged: new tokens per live sequence, the last q_len of its context
    num_tokens: int = 0  # ragged: the token bucket T, >= sum(q_lens); the rest are padding rows
    num_slots: int = 0  # ragged: S >= len(kv_lens); the slots past the live ones are dead
    block_kv: int | None = None  # kv tokens per kernel step; None: the kernel's default (what the engine runs)

    def __post_init__(self):
        # A plan's mistakes show on the CPU, when the plan is built, not minutes into a device run.
        if self.op not in ("decode", "ragged") or self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.name}: op must be decode or ragged, and N a multiple of K")
        if self.op == "ragged" and not (
            len(self.q_lens) == len(self.kv_lens) <= self.num_slots
            and all(0 < q <= kv for q, kv in zip(self.q_lens, self.kv_lens))
            and sum(self.q_lens) <= self.num_tokens
        ):
            raise ValueError(f"{self.name}: a q_len (> 0, <= kv_len) per sequence, in num_slots and num_tokens")

    def kernel_options(self) -> dict:
        """The options the kernel takes beyond its reference's."""
        return {} if self.block_kv is None else dict(block_kv=self.block_kv)

    def kv_bytes(self) -> int:
        """K and V bytes of every live context token (and its scales, int8): what any exact kernel must read."""
        per_row = self.head_dim * (1 if self.kv_int8 else _itemsize(self.dtype)) + (4 if self.kv_int8 else 0)
        return 2 * sum(self.kv_lens) * self.num_kv_heads * per_row


@dataclasses.dataclass(frozen=True)
class EngineRun:
    """A model and a mixed greedy workload for the engine comparisons."""

    model: str  # a named config; its shapes, with `initializer_range` as init
    initializer_range: float
    num_requests: int
    prompt_range: tuple[int, int]
    max_tokens_range: tuple[int, int]
    options: dict  # engine options shared by both engines of a comparison


@dataclasses.dataclass(frozen=True)
class Plan:
    size: str
    kernel_cases: tuple[KernelCase, ...]
    engine: EngineRun
    engine_kv_cache_dtypes: tuple[str, ...]  # the engine comparison runs once per KV page dtype
    bandwidth_cases: tuple[KernelCase, ...]
    copy_bytes: int  # the array the device copy reads (and writes)
    timed_runs: int
    throughput_models: tuple[str, ...]
    throughput_workload: dict  # make_workload fields (cbjax/bench/workload.py)
    throughput_flags: tuple[str, ...]  # more experiments.throughput flags
    tensor_parallel: EngineRun
    section_timeout_s: int  # per isolated section; the throughput section splits it between its models


def _itemsize(dtype: str) -> int:
    return {"float32": 4, "bfloat16": 2}[dtype]


def _lens(rng, n: int, top: int, edges=()) -> tuple[int, ...]:
    """`edges` then random context lengths in [1, top] up to n of them."""
    return tuple(int(x) for x in (*edges, *rng.integers(1, top + 1, n - len(edges))))


def small_plan():
    """Toy sizes for CPU (interpret mode), seconds each; the same code paths as full."""
    import numpy as np

    rng = np.random.default_rng(0)
    shape = dict(num_heads=4, num_kv_heads=2, head_dim=64, page_size=8)
    decode_lens = (0, 1, 7, 8, 9, 40)  # empty slot, page edges, the longest
    # block_kv 16: two pages per DMA chunk, so a sequence takes several chunks and the interpreted program stays
    # small (the default 128 unrolls 16 page copies per chunk and takes 4x longer to interpret).
    ragged = dict(q_lens=(12, 1, 5, 1), kv_lens=(30, 9, 5, 40), num_tokens=32, num_slots=6, block_kv=16)
    kernels = (
        KernelCase("decode f32", "decode", decode_lens, dtype="float32", **shape),
        KernelCase(
            "decode int8 kv",
            "decode",
            decode_lens,
            dtype="float32",
            kv_int8=True,
            sliding_window=11,
            soft_cap=20.0,
            **shape,
        ),
        KernelCase("ragged f32", "ragged", dtype="float32", **ragged, **shape),
        KernelCase("ragged int8 kv", "ragged", dtype="bfloat16", kv_int8=True, **ragged, **shape),
    )
    # One token bucket (16): each program that runs the interpreted kernel costs ~10 s to build on a small CPU.
    engine_opts = dict(max_num_seqs=4, max_num_batched_tokens=16, page_size=16, num_pages=64, max_model_len=72)
    return Plan(
        size="small",
        kernel_cases=kernels,
        engine=EngineRun("test-tiny", 0.2, 8, (1, 60), (1, 8), engine_opts),
        # int8 pages through the engine's Pallas path are tests/test_engine_pallas.py's on CPU; here only at full.
        engine_kv_cache_dtypes=("auto",),
        bandwidth_cases=(KernelCase("decode f32", "decode", _lens(rng, 4, 64), dtype="float32", **shape),),
        copy_bytes=16 << 20,
        timed_runs=3,
        throughput_models=("llama-tiny",),
        throughput_workload=dict(kind="mixed", num_requests=6, scale=0.02, seed=0),
        throughput_flags=("--max_num_seqs=4", "--max_num_batched_tokens=16", "--num_pages=64", "--max_model_len=128"),
        tensor_parallel=EngineRun("test-tiny", 0.2, 6, (1, 60), (1, 8), engine_opts),
        section_timeout_s=300,
    )


def full_plan():
    """Realistic sizes for one TPU chip or GPU, meant to fit 10 minutes there (on an H200 on 2026-12-04 the kernels,
    engine and throughput sections took 5.6 minutes, docs/kernels.md)."""
    import numpy as np

    rng = np.random.default_rng(0)
    heads = dict(num_heads=32, num_kv_heads=8, head_dim=128)  # 8B-like attention
    g16, g32 = dict(page_size=16, **heads), dict(page_size=32, **heads)
    decode_lens = _lens(rng, 64, 4096, edges=(0, 1, 15, 16, 17, 4096))
    # A 256-token step: a later 96-token chunk of a 2k prompt, a whole 64-token prompt, a 1-token prompt and 64
    # decodes with contexts to 2k, in 96 slots (29 dead).
    ragged = dict(
        q_lens=(96, 64, 1) + (1,) * 64,
        kv_lens=(2048, 64, 1) + _lens(rng, 64, 2048),
        num_tokens=256,
        num_slots=96,
    )
    kernels = (
        KernelCase("decode bf16 G16", "decode", decode_lens, dtype="bfloat16", **g16),
        KernelCase(
            "decode f32 G32 window+cap",
            "decode",
            _lens(rng, 32, 2048, edges=(0, 2048)),
            dtype="float32",
            sliding_window=1000,
            soft_cap=30.0,
            **g32,
        ),
        KernelCase("decode int8 kv G16", "decode", decode_lens, dtype="bfloat16", kv_int8=True, **g16),
        KernelCase("ragged bf16 G16", "ragged", dtype="bfloat16", **ragged, **g16),
        KernelCase(
            "ragged f32 G32 window+cap", "ragged", dtype="float32", sliding_window=512, soft_cap=30.0, **ragged, **g32
        ),
        KernelCase("ragged int8 kv G16", "ragged", dtype="bfloat16", kv_int8=True, **ragged, **g16),
    )
    full_ctx = (4096,) * 64  # 1 GiB of bf16 K and V: far more than any cache, so HBM is what is timed
    engine_opts = dict(max_num_seqs=16, max_num_batched_tokens=256, page_size=16, num_pages=1024, max_model_len=768)
    return Plan(
        size="full",
        kernel_cases=kernels,
        engine=EngineRun("llama-tiny", 0.2, 32, (1, 700), (1, 40), engine_opts),
        engine_kv_cache_dtypes=("auto", "int8"),
        bandwidth_cases=(
            KernelCase("decode bf16 B64 ctx4096", "decode", full_ctx, dtype="bfloat16", **g16),
            KernelCase("decode int8 kv B64 ctx4096", "decode", full_ctx, dtype="bfloat16", kv_int8=True, **g16),
        ),
        copy_bytes=1 << 30,
        timed_runs=20,
        throughput_models=("llama-tiny", "llama-small"),
        throughput_workload=dict(kind="mixed", num_requests=96, scale=0.3, seed=0),  # docs/tpu.md's workload
        throughput_flags=("--dtype=bfloat16",),
        tensor_parallel=EngineRun("llama-tiny", 0.2, 16, (1, 700), (1, 24), engine_opts),
        section_timeout_s=600,  # a cap against a hang, not an expectation
    )


PLANS = {"small": small_plan, "full": full_plan}
