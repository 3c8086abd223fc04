"""LoadConfig: how the model's weights are loaded and computed with (dtypes, weight quantization, the CPU matmul),
and the seed of a random model and of the requests' default sampling seeds."""

import dataclasses

from cbjax.config import validation as check
from cbjax.config.section import Section

DTYPES = ("float32", "bfloat16", "float16")
QUANTIZATIONS = ("int8",)  # weight-only int8 linears and LM head (cbjax/model/quantize.py)
# The float32 linears on the CPU backend: "auto" / "packed" (a C++ matmul over weights packed at load time,
# cbjax/model/linear_impl.py) or "xla" (XLA's dot).
CPU_MATMULS = ("auto", "packed", "xla")


@dataclasses.dataclass(frozen=True)
class LoadConfig(Section):
    dtype: str | None = None  # parameter / activation dtype; None: the model config's (a checkpoint's own)
    matmul_dtype: str | None = None  # the linear layers' weights and matmul inputs (ModelConfig.matmul_dtype)
    # "int8": weight-only int8 linears and LM head, one scale per output channel (cbjax/model/quantize.py); None: off.
    quantization: str | None = None
    cpu_matmul: str = "auto"  # one of CPU_MATMULS; the CBJAX_MATMUL environment variable overrides it
    seed: int = 0  # model init (random models) and the default per-request sampling seeds

    def checked(self) -> dict:
        return dict(
            dtype=check.choice("dtype", self.dtype, (None, *DTYPES)),
            matmul_dtype=check.choice("matmul_dtype", self.matmul_dtype, (None, *DTYPES)),
            quantization=check.choice("quantization", self.quantization, (None, *QUANTIZATIONS)),
            cpu_matmul=check.choice("cpu_matmul", self.cpu_matmul, CPU_MATMULS),
            seed=check.integer("seed", self.seed, 0, 2**32 - 1),
        )
