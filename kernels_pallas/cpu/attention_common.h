// What the CPU attention kernels share (decode_attention.cc, prefill_attention.cc, attention_ffi.cc):
// the problem and work-item types, loads that widen bf16 / int8 to f32, a branch-free exp, the AVX-512 dot and
// row accumulation, and the clamped page lookup. One header so that every translation unit inlines the same
// primitives (they sit in the innermost loops).

#ifndef CBJAX_CPU_ATTENTION_COMMON_H_
#define CBJAX_CPU_ATTENTION_COMMON_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "xla/ffi/api/ffi.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace cbjax_cpu {

struct Bf16 {
  uint16_t bits;
};

inline float load(float x) { return x; }
inline float load(int8_t x) { return static_cast<float>(x); }
inline float load(Bf16 x) {
  uint32_t u = static_cast<uint32_t>(x.bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline void store(float* dst, float x) { *dst = x; }
inline void store(Bf16* dst, float x) {  // round to nearest even (NaN is not produced here)
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  u += 0x7fffu + ((u >> 16) & 1u);
  dst->bits = static_cast<uint16_t>(u >> 16);
}

#if defined(__AVX512F__)
inline __m512 load16(const float* x) { return _mm512_loadu_ps(x); }
inline __m512 load16(const int8_t* x) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x))));
}
inline __m512 load16(const Bf16* x) {
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#endif

// exp(x) for x <= 0 (scores minus their max), relative error ~1e-7; branch-free so loops over it vectorise.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float kMagic = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  float n = (x * 1.44269504088896341f + kMagic) - kMagic;
  float r = x - n * 0.693359375f;  // ln 2 split in two for precision
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  float y = p * r * r + r + 1.0f;
  int32_t e = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &e, sizeof scale);
  return y * scale;
}

// q . k over H elements. With AVX-512 and H a multiple of 16: 16-lane FMAs into two accumulators and one tree
// reduction (g++ reduces an `omp simd` dot lane by lane, in order: a 16-deep add chain per score).
template <typename E, int HC>
inline float dot(const float* __restrict q, const E* __restrict k, int64_t H) {
#if defined(__AVX512F__)
  if constexpr (HC > 0 && HC % 16 == 0) {
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    for (int c = 0; c < HC; c += 32) {
      a0 = _mm512_fmadd_ps(_mm512_loadu_ps(q + c), load16(k + c), a0);
      if (c + 16 < HC) a1 = _mm512_fmadd_ps(_mm512_loadu_ps(q + c + 16), load16(k + c + 16), a1);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
  }
#endif
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int64_t h = 0; h < H; ++h) s += q[h] * load(k[h]);
  return s;
}

// acc[:H] += sum over t < count of w[t] * v[t, :H] (v rows contiguous). With AVX-512 and H a multiple of 16 the
// accumulator row lives in registers for the whole run of rows.
template <typename E, int HC>
inline void accumulate(float* __restrict acc, const float* __restrict w, const E* __restrict v, int64_t count,
                       int64_t H) {
#if defined(__AVX512F__)
  if constexpr (HC > 0 && HC % 16 == 0) {
    constexpr int C = HC / 16;
    __m512 a[C];
    for (int c = 0; c < C; ++c) a[c] = _mm512_loadu_ps(acc + 16 * c);
    for (int64_t t = 0; t < count; ++t) {
      const __m512 wt = _mm512_set1_ps(w[t]);
      for (int c = 0; c < C; ++c) a[c] = _mm512_fmadd_ps(wt, load16(v + t * HC + 16 * c), a[c]);
    }
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + 16 * c, a[c]);
    return;
  }
#endif
  for (int64_t t = 0; t < count; ++t) {
    const float wt = w[t];
#pragma omp simd
    for (int64_t h = 0; h < H; ++h) acc[h] += wt * load(v[t * H + h]);
  }
}

struct Problem {
  int64_t T, N, H, K, P, G, S, W, R;
  float scale;     // sm_scale
  float soft_cap;  // <= 0: none
  int32_t window;  // <= 0: none
  const void* q;
  const void* k;
  const void* v;
  const float* k_scales;  // int8 pages: [K, P, G] (the trailing 1 dropped); else null
  const float* v_scales;
  void* out;
  const int32_t* page_indices;

  // The page holding context position `pos` of sequence `seq`, clamped to [0, P) so that a bad table entry
  // cannot read out of bounds (callers only look up positions below the sequence's kv_len).
  int64_t page_of(int32_t seq, int64_t pos) const {
    const int64_t page = page_indices[static_cast<int64_t>(seq) * W + pos / G];
    return std::min<int64_t>(std::max<int64_t>(page, 0), P - 1);
  }
};

// `rows` query rows from `row` on, of sequence `seq`; row j sees context positions [start_j, end + j) where end
// is row 0's causal end and start_j = max(0, end + j - window) (start = start_0). Decode items have rows == 1.
struct Item {
  int32_t seq, row, rows, start, end;
};

// Per-thread scratch, reused across items.
struct Scratch {
  std::vector<float> q, s, acc, m, l, kt, v;
};

using AttendFn = void (*)(const Problem&, const Item&, int64_t kv_head, Scratch&);

// The kernels for q's dtype, the pages' dtype (F32, BF16 or S8) and the head dim.
AttendFn pick_decode(xla::ffi::DataType q, xla::ffi::DataType kv, int64_t H);
AttendFn pick_prefill(xla::ffi::DataType q, xla::ffi::DataType kv, int64_t H);
// The decode kernel with AVX512-BF16 dot products (q and the softmax weights rounded to bf16) for bf16 pages;
// null where it does not apply (other pages, a head dim not a multiple of 32, a build without AVX512-BF16).
AttendFn pick_decode_bf16_dots(xla::ffi::DataType q, xla::ffi::DataType kv, int64_t H);

// Instantiates KERNEL<Q, E, HC> for the (q dtype, kv dtype, head dim) at hand: HC is the head dim for the common
// ones (fully unrolled, in registers) and 0 (runtime H) otherwise.
template <template <typename, typename, int> class KERNEL>
struct Picker {
  template <typename Q, typename E>
  static AttendFn by_head_dim(int64_t H) {
    switch (H) {
      case 16:
        return KERNEL<Q, E, 16>::run;
      case 32:
        return KERNEL<Q, E, 32>::run;
      case 64:
        return KERNEL<Q, E, 64>::run;
      case 128:
        return KERNEL<Q, E, 128>::run;
      case 256:
        return KERNEL<Q, E, 256>::run;
      default:
        return KERNEL<Q, E, 0>::run;
    }
  }
  template <typename Q>
  static AttendFn by_kv(xla::ffi::DataType kv, int64_t H) {
    if (kv == xla::ffi::DataType::S8) return by_head_dim<Q, int8_t>(H);
    return kv == xla::ffi::DataType::F32 ? by_head_dim<Q, float>(H) : by_head_dim<Q, Bf16>(H);
  }
  static AttendFn pick(xla::ffi::DataType q, xla::ffi::DataType kv, int64_t H) {
    return q == xla::ffi::DataType::F32 ? by_kv<float>(kv, H) : by_kv<Bf16>(kv, H);
  }
};

}  // namespace cbjax_cpu

#endif  // CBJAX_CPU_ATTENTION_COMMON_H_
