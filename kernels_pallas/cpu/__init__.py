"""The CPU kernels in C++, called from jax as XLA FFI custom calls: ragged paged attention (attention.py over
attention_ffi.cc, decode_attention.cc, prefill_attention.cc, attention_common.h) and the float32 matmul over
pre-packed weights (gemm.py over gemm.cc), their threads sharing one work queue (work_queue.h). They exist because
XLA:CPU lowers these ops to gathers and tiny dots far below the memory bandwidth; on TPU and GPU the Pallas kernels
of the parent package do the work instead. All of the C++ is one shared library, which library.py compiles with
the system C++ compiler on first use (not at import) into a per-user cache keyed on every source file, the flags,
the compiler, jaxlib and the CPU. Each build is logged at INFO on the "cbjax" logger with its reason and duration;
without a compiler, or when the build fails, the wrappers' `available()` is False, `unavailable_reason()` says why,
and the callers log that once as a warning and take the XLA path. Which kernels `auto` takes depends on the
build (with or without AVX-512, build_info.cc says which): auto.py holds that measured table. Import the
submodules you need (`from kernels_pallas.cpu import attention, gemm`): this package imports nothing itself.
"""
