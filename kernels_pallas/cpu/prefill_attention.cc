// Paged prefill attention for CPU: the rows of sequences with q_len > 1 (fresh prompts, chunks after earlier
// context, speculative verify rows). The handler, threads and checks are in attention_ffi.cc.
//
// An item is (sequence, block of `rows` consecutive query rows, kv head): its M = rows x R query vectors (the R
// query heads of the kv head) share every K/V row it reads. Row j sits at position end - 1 + j and sees
// [max(0, end + j - window), end + j). The item walks its context [start, end + rows - 1) in blocks of kC
// positions with an online softmax in f32 (running max and sum per query vector, rescaled per block).
//
// Layout: the queries go across the vector lanes. Per item the queries are transposed once into qt [H, Mp]
// (Mp = M rounded up to 16), so that both products of a block are small GEMMs with broadcast operands and
// lane-wise accumulators (no horizontal sums):
//   scores s[c, m] = sum_h kf[c, h] * qt[h, m]            (kf: the block's K rows in f32, [kC, H])
//   acc[h, m]     += sum_c vf[c, h] * p[c, m]             (vf: the block's V rows in f32; p: s after softmax)
// and the softmax's max, exp, sum and rescale are lane-wise too. acc [H, Mp] is transposed back on output.
//
// Only positions below the item's last causal end (<= kv_len) are read, through the clamped page lookup, so NaN
// in unused pages, rows past kv_len and garbage page-table entries past the used pages never reach an output;
// masked scores are -inf and their weights are selected to exactly 0 (never multiplied), and the f32 block rows
// past the context are zeros. int8 rows are dequantized (times their scale) when a block is converted to f32.

#include "attention_common.h"

namespace cbjax_cpu {
namespace {

constexpr int64_t kC = 64;  // context positions per block
constexpr float kNoMax = -1e30f;  // the running max before any visible position (finite: no inf - inf)

// out[i, :width] (+)= sum over k < depth of a[i * a_row + k * a_k] * b[k * b_row, :width] for i < rows; width a
// multiple of 16. AVX-512: 4 output rows x `T` 16-lane tiles of accumulators in registers, one broadcast of `a`
// per row and step; other CPUs (and tails): loops that g++ vectorises.
template <int T>
inline void gemm_tile(float* out, int64_t out_row, const float* a, int64_t a_row, int64_t a_k, const float* b,
                      int64_t b_row, int64_t depth, bool accumulate) {
#if defined(__AVX512F__)
  __m512 acc[4][T];
  for (int i = 0; i < 4; ++i)
    for (int t = 0; t < T; ++t) acc[i][t] = accumulate ? _mm512_loadu_ps(out + i * out_row + 16 * t) : _mm512_setzero_ps();
  for (int64_t k = 0; k < depth; ++k) {
    __m512 bk[T];
    for (int t = 0; t < T; ++t) bk[t] = _mm512_loadu_ps(b + k * b_row + 16 * t);
    for (int i = 0; i < 4; ++i) {
      const __m512 ai = _mm512_set1_ps(a[i * a_row + k * a_k]);
      for (int t = 0; t < T; ++t) acc[i][t] = _mm512_fmadd_ps(ai, bk[t], acc[i][t]);
    }
  }
  for (int i = 0; i < 4; ++i)
    for (int t = 0; t < T; ++t) _mm512_storeu_ps(out + i * out_row + 16 * t, acc[i][t]);
#else
  (void)out, (void)out_row, (void)a, (void)a_row, (void)a_k, (void)b, (void)b_row, (void)depth, (void)accumulate;
#endif
}

inline void gemm_generic(float* out, int64_t out_row, const float* a, int64_t a_row, int64_t a_k, const float* b,
                         int64_t b_row, int64_t rows, int64_t width, int64_t depth, bool accumulate) {
  for (int64_t i = 0; i < rows; ++i) {
    float* __restrict o = out + i * out_row;
    if (!accumulate) std::fill(o, o + width, 0.0f);
    for (int64_t k = 0; k < depth; ++k) {
      const float w = a[i * a_row + k * a_k];
      const float* __restrict bk = b + k * b_row;
#pragma omp simd
      for (int64_t l = 0; l < width; ++l) o[l] += w * bk[l];
    }
  }
}

// The block product over all rows and lanes: 4 x 64-lane register tiles, then 4 x 16, then the generic tail.
inline void gemm(float* out, int64_t out_row, const float* a, int64_t a_row, int64_t a_k, const float* b,
                 int64_t b_row, int64_t rows, int64_t width, int64_t depth, bool accumulate) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 4 <= rows; i += 4) {
    int64_t l = 0;
    for (; l + 64 <= width; l += 64)
      gemm_tile<4>(out + i * out_row + l, out_row, a + i * a_row, a_row, a_k, b + l, b_row, depth, accumulate);
    for (; l < width; l += 16)
      gemm_tile<1>(out + i * out_row + l, out_row, a + i * a_row, a_row, a_k, b + l, b_row, depth, accumulate);
  }
#endif
  gemm_generic(out + i * out_row, out_row, a + i * a_row, a_row, a_k, b, b_row, rows - i, width, depth, accumulate);
}

// soft_cap * tanh(x / soft_cap), branch-free through exp_nonpositive so the score loop vectorises.
inline float soft_capped(float x, float cap) {
  const float y = x / cap;
  const float t = exp_nonpositive(-2.0f * std::fabs(y));  // tanh(|y|) = (1 - t) / (1 + t)
  const float th = (1.0f - t) / (1.0f + t);
  return cap * (y < 0.0f ? -th : th);
}

template <typename Q, typename E, int HC>
struct Prefill {
  static void run(const Problem& p, const Item& it, int64_t kh, Scratch& sc);
};

template <typename Q, typename E, int HC>
void Prefill<Q, E, HC>::run(const Problem& p, const Item& it, int64_t kh, Scratch& sc) {
  const int64_t H = HC > 0 ? HC : p.H;
  const int64_t R = p.R, G = p.G;
  const int64_t M = it.rows * R, Mp = (M + 15) / 16 * 16;
  const int64_t hi = static_cast<int64_t>(it.end) + it.rows - 1;  // the last row's causal end
  sc.q.assign(H * Mp, 0.0f);    // qt [H, Mp]
  sc.acc.assign(H * Mp, 0.0f);  // acc [H, Mp]
  sc.s.assign(kC * Mp, 0.0f);   // scores, then weights [kC, Mp]
  sc.kt.assign(kC * H, 0.0f);   // kf [kC, H]
  sc.v.assign(kC * H, 0.0f);    // vf [kC, H]
  sc.m.assign(3 * Mp, kNoMax);  // running max, then the block's max and alpha
  sc.l.assign(Mp, 0.0f);
  float* __restrict qt = sc.q.data();
  float* __restrict acc = sc.acc.data();
  float* __restrict s = sc.s.data();
  float* __restrict kf = sc.kt.data();
  float* __restrict vf = sc.v.data();
  float* __restrict run_max = sc.m.data();
  float* __restrict blk_max = run_max + Mp;
  float* __restrict alpha = blk_max + Mp;
  float* __restrict l = sc.l.data();
  // Per query vector: the last and first position it sees (lanes past M see nothing: last = -1).
  std::vector<int32_t> bounds(2 * Mp, -1);
  int32_t* __restrict last = bounds.data();
  int32_t* __restrict first = last + Mp;
  for (int64_t m = 0; m < M; ++m) {
    last[m] = it.end - 1 + static_cast<int32_t>(m / R);
    first[m] = p.window > 0 ? std::max(last[m] - p.window + 1, 0) : 0;
  }
  for (int64_t j = 0; j < it.rows; ++j) {
    const Q* src = static_cast<const Q*>(p.q) + ((it.row + j) * p.N + kh * R) * H;
    for (int64_t r = 0; r < R; ++r)
      for (int64_t h = 0; h < H; ++h) qt[h * Mp + j * R + r] = load(src[r * H + h]) * p.scale;
  }

  const E* kbase = static_cast<const E*>(p.k) + kh * p.P * G * H;
  const E* vbase = static_cast<const E*>(p.v) + kh * p.P * G * H;
  const float* kscale = p.k_scales ? p.k_scales + kh * p.P * G : nullptr;
  const float* vscale = p.v_scales ? p.v_scales + kh * p.P * G : nullptr;
  const float cap = p.soft_cap;

  for (int64_t blk = it.start; blk < hi; blk += kC) {
    const int64_t n = std::min(kC, hi - blk);
    for (int64_t c = 0; c < n; ++c) {  // K and V rows in f32 (int8: times their scale); rows past n stay zero
      const int64_t pos = blk + c, row = p.page_of(it.seq, pos) * G + pos % G;
      const E* __restrict kr = kbase + row * H;
      const E* __restrict vr = vbase + row * H;
      const float ks = kscale ? kscale[row] : 1.0f, vs = vscale ? vscale[row] : 1.0f;
#pragma omp simd
      for (int64_t h = 0; h < H; ++h) {
        kf[c * H + h] = load(kr[h]) * ks;
        vf[c * H + h] = load(vr[h]) * vs;
      }
    }
    const int64_t n4 = (n + 3) / 4 * 4;
    gemm(s, Mp, kf, H, 1, qt, Mp, n4, Mp, H, false);

    if (cap > 0.0f) {
      for (int64_t c = 0; c < n; ++c) {
        float* __restrict sc_row = s + c * Mp;
#pragma omp simd
        for (int64_t m = 0; m < Mp; ++m) sc_row[m] = soft_capped(sc_row[m], cap);
      }
    }
    // Mask (-inf) and the block's max per query vector.
    std::copy(run_max, run_max + Mp, blk_max);
    for (int64_t c = 0; c < n; ++c) {
      float* __restrict sc_row = s + c * Mp;
      const int32_t pos = static_cast<int32_t>(blk + c);
#pragma omp simd
      for (int64_t m = 0; m < Mp; ++m) {
        const float x = (pos <= last[m] && pos >= first[m]) ? sc_row[m] : -INFINITY;
        sc_row[m] = x;
        blk_max[m] = std::max(blk_max[m], x);
      }
    }
#pragma omp simd
    for (int64_t m = 0; m < Mp; ++m) {
      alpha[m] = exp_nonpositive(run_max[m] - blk_max[m]);
      run_max[m] = blk_max[m];
      l[m] *= alpha[m];
    }
    for (int64_t c = 0; c < n; ++c) {  // weights, selected (not multiplied) to 0 where masked
      float* __restrict sc_row = s + c * Mp;
#pragma omp simd
      for (int64_t m = 0; m < Mp; ++m) {
        const float x = sc_row[m];
        const float e = x == -INFINITY ? 0.0f : exp_nonpositive(x - run_max[m]);
        sc_row[m] = e;
        l[m] += e;
      }
    }
    for (int64_t h = 0; h < H; ++h) {
      float* __restrict ah = acc + h * Mp;
#pragma omp simd
      for (int64_t m = 0; m < Mp; ++m) ah[m] *= alpha[m];
    }
    gemm(acc, Mp, vf, 1, H, s, Mp, H, Mp, n, true);
  }

  Q* out = static_cast<Q*>(p.out);
  for (int64_t m = 0; m < M; ++m) {
    const float inv = l[m] > 0.0f ? 1.0f / l[m] : 0.0f;  // every real row sees its own position: l >= 1
    Q* o = out + ((it.row + m / R) * p.N + kh * R + m % R) * H;
    for (int64_t h = 0; h < H; ++h) store(o + h, acc[h * Mp + m] * inv);
  }
}

}  // namespace

AttendFn pick_prefill(xla::ffi::DataType q, xla::ffi::DataType kv, int64_t H) {
  return Picker<Prefill>::pick(q, kv, H);
}

}  // namespace cbjax_cpu
