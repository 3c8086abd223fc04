// What the shared library was compiled with, for library.py's features(): the tests check that the portable
// build ("no-avx512") really left the AVX-512 paths out, and `auto` picks per instruction set by what was built,
// not by what the CPU's flags promise.

extern "C" int CbjaxCpuKernelsBuildInfo() {
  int bits = 0;
#if defined(__AVX512F__)
  bits |= 1;  // the AVX-512 fast paths of attention_common.h, decode_attention.cc, prefill_attention.cc, gemm.cc
#endif
#if defined(__AVX2__)
  bits |= 2;
#endif
#if defined(__AVX512BF16__)
  bits |= 8;  // the bf16 matmul's vdpbf16ps path (gemm.cc); without it, its portable loop
#endif
#if defined(CBJAX_CHECKED) && CBJAX_CHECKED
  bits |= 4;  // bad page ids and context lengths are errors (attention_ffi.cc)
#endif
  return bits;
}
