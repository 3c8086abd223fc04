// y[M, N] = x[M, K] @ w for CPU, with w pre-packed into panels, as one XLA FFI handler (gemm.py packs the
// weights and calls it; library.py builds the shared library and registers both handlers).
//
// Why packed: at decode sizes (M = 1..64 rows) a GEMM is bound by reading the weights. A library GEMM re-packs
// B on every call (one more read and write of every weight per step), and walking B [K, N] row by row for a
// block of columns touches a new 4 KiB page at every k. Packed once at load time into panels [P, K, NR]
// (P = ceil(N / NR); panel p holds columns p*NR .. p*NR + NR - 1 for every k, contiguously, zero-padded past N),
// each panel is one linear stream that the hardware prefetcher follows, read once from memory per call and
// then from L2 for the other row blocks.
//
// Microkernel: R rows x C panels (C * 32 columns) of accumulators in registers, walking k: load each panel's
// k-row (two zmm per panel), broadcast x[r, k] and FMA into the row's 2 * C accumulators. Two shapes:
// - decode sizes (a chunk of at most 2 * kMR = 24 rows): R <= kMR = 12 rows x 1 panel (24 of the 32 zmm), so a
//   chunk's panels are read in at most two passes;
// - larger chunks: R <= kWideMR = 6 rows x 2 panels (also 24 accumulators). Fewer rows per block matter there:
//   when K = 1024 the rows of x lie 4 KiB apart, all in one set of the L1, and 12 of them (plus the panel's
//   lines) overflow an 8-way L1 (Zen 4), so the broadcasts of x miss it; the compute-bound large-M matmuls ran at
//   0.74-0.96x XLA's dot with 12 x 1 and at 1.01-1.21x with 6 x 2 (bench_cpu_gemm, Zen 4, 2026-12-02).
// The rows of a chunk are split into blocks of near-equal size (16 rows: 8 + 8 rather than 12 + 4), so no block
// runs with only a few rows' worth of FMAs per panel load.
//
// Summation order: every output element is acc = fma(x[m, k], w[k, n], acc) for k = 0 .. K-1 from acc = 0, in
// one register lane, whatever the block size R, the row's place in its block, M or the thread count. So a row's
// result is bitwise the same alone or in any batch (the engine's token-exactness tests compare a batch against
// separate forwards), and the same with 1 or 2 threads: an output element is computed by one thread, whole.
//
// Work items: (chunk of rows, group of kPanelsPerItem panels). A chunk is as many rows as keep x's chunk
// (rows x K floats) in about 1 MiB of L2 while every panel streams past it; at decode sizes there is one chunk and
// every weight is read from memory once per call. Threads: the calling thread and up to num_threads - 1 helpers on
// XLA's intra-op pool take items from one queue (work_queue.h).
//
// Prefetching and the measurements behind it: at kPrefetch below. Tried and dropped, on this 2-core Sapphire
// Rapids: copying each row block of x to [K, R] (its rows 4 KiB apart when K = 1024 share an L1 set; no change
// measured, in or out of a padded stride), and K-slices of a panel kept in L1 across the row blocks (none at
// M = 4..16, 5-10% slower at M = 64..256 on the MLP chain). Block sizes kMR = 8 and 14 were within the noise.
// On a Zen 4: 6 x 2 blocks at decode sizes too (up to 20% slower at M = 8, where one pass over the panels wins),
// 4 x 2, 4 x 3 (slower still) and 8 x 1 (as fast as 6 x 2 alone, in a one-thread test outside XLA).
//
// Without AVX-512 the same loops run on plain arrays (the compiler vectorises the 32 columns for what it has).
//
// bfloat16 (the handlers *Bf16: a model with matmul_dtype bfloat16): x [M, K] and the weights in bf16, the sums in
// float32. The panels hold k-pairs: [P, ceil(K / 2), kNR, 2], element [p, kk, j, t] = w[2 kk + t, p kNR + j] (zero
// past K and N), so one 128-byte pair-row of a panel is two zmm of 16 columns x 2 k, the operand of AVX512-BF16's
// vdpbf16ps: acc[j] += x[2kk] w[2kk, j] + x[2kk + 1] w[2kk + 1, j] (products exact in float32, each add rounded),
// with x's pair broadcast as one 32-bit lane. Half the bytes of the float32 panels per weight (decode sizes are
// bound by reading them) and two multiply-adds per lane per instruction. Every output element is still one chain
// over kk = 0 .. ceil(K / 2) - 1, so the bitwise independence of M and of the thread count holds as for float32.
// Without AVX512-BF16 (`__AVX512BF16__` undefined: an older CPU or the no-avx512 build) the bf16 handlers run a
// portable loop that widens each bf16 to float32 and sums k = 0 .. K-1 in order: same results up to rounding.

#include <algorithm>
#include <array>
#include <cstdint>
#include <cmath>
#include <cstring>
#include <memory>
#include <utility>
#include <vector>

#include "work_queue.h"
#include "xla/ffi/api/ffi.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <type_traits>

namespace ffi = xla::ffi;

namespace cbjax_gemm {
namespace {

constexpr int64_t kNR = 32;  // columns per panel; gemm.py's NR must match
#if defined(__AVX512F__)
// Register blocks: up to kMR rows x 1 panel (2 * 12 accumulators + 2 panel registers + 1 broadcast), or, for
// chunks of more than 2 * kMR rows, up to kWideMR rows x kWidePanels panels (2 * 6 * 2 + 4 + 1).
constexpr int kMR = 12, kWideMR = 6, kWidePanels = 2;
#else
constexpr int kMR = 8, kWideMR = 8, kWidePanels = 1;
#endif
constexpr int64_t kPanelsPerItem = 4;          // 128 columns per work item: few items, still enough to balance
constexpr int64_t kChunkBytes = 1 << 20;       // x's share of L2 per row chunk
constexpr int64_t kMinWorkPerThread = 1 << 20;  // multiply-adds below which a helper costs more than it saves

// Software prefetch of the panel 2048 floats (64 k-rows, 8 KiB) ahead: the hardware prefetchers stop at every
// 4 KiB page, i.e. every 32 k-rows of a panel. A prefetch past the end of the weights is harmless (prefetches
// never fault). The first row block of a panel also asks for the next panel into L2 (the later blocks read the
// current one from L2 meanwhile). Measured on the chain of bench_cpu_gemm.py (8 MLP layers, weights out of
// cache), A/B through a temporary runtime switch in interleaved rounds (edit the code to redo it): the k-row
// prefetch +30% at M = 16 and +15% at M = 64 over none, 1024 to 4096 floats ahead alike; the next-panel one
// +3-5% more at M = 4..64 (medians of 9 rounds), and no better than none when every block asks.
constexpr int64_t kPrefetch = 2048;
// The same 8 KiB ahead in a bf16 panel: 64 pair-rows of 128 bytes.
constexpr int64_t kPrefetchBf16 = 4096;

using bf16 = uint16_t;  // XLA FFI's BF16 element: the upper half of a float32's bits

// Elements of one panel of the packed weights: [K, kNR] float32, or [ceil(K / 2), kNR, 2] bf16.
template <typename T>
constexpr int64_t panel_elems(int64_t K) {
  return std::is_same_v<T, float> ? K * kNR : (K + 1) / 2 * 2 * kNR;
}

template <typename T>  // float, or bf16 for the bf16 handlers
struct Gemm {
  const T* x;  // [M, K]
  const T* w;  // [P, panel_elems(K)]
  float* y;    // [M, N]; null for the argmax kernel
  int64_t M, K, N, P, chunk;
  float* best;        // argmax: [groups, M] the best value of each (panel group, row) (NaN: a NaN was seen)
  int32_t* best_col;  // argmax: [groups, M] its column
};

// The argmax kernel folds each row's sums of a panel into the row's running best instead of storing them: the
// first NaN wins, else the largest value, the lowest column on ties, as jnp.argmax and the sampler's argmax_last
// pick. The sums are the plain kernel's, bit for bit, so the fused greedy head picks the token the unfused one
// would. Columns past N (the last panel's zero padding) never win.
inline void fold_best(const float* v, int64_t cols, int64_t col, float& best, int32_t& best_col) {
  if (std::isnan(best)) return;
  for (int64_t j = 0; j < cols; ++j) {
    if (std::isnan(v[j])) {
      best = v[j];
      best_col = static_cast<int32_t>(col + j);
      return;
    }
    if (v[j] > best) {
      best = v[j];
      best_col = static_cast<int32_t>(col + j);
    }
  }
}

#if defined(__AVX512F__)
inline void fold_best(__m512 v0, __m512 v1, __mmask16 m0, __mmask16 m1, int64_t col, float& best,
                      int32_t& best_col) {
  if (std::isnan(best)) return;
  const __m512 lowest = _mm512_set1_ps(-INFINITY);
  v0 = _mm512_mask_blend_ps(m0, lowest, v0);
  v1 = _mm512_mask_blend_ps(m1, lowest, v1);
  const uint32_t nan = static_cast<uint32_t>(_mm512_cmp_ps_mask(v0, v0, _CMP_UNORD_Q)) |
                       static_cast<uint32_t>(_mm512_cmp_ps_mask(v1, v1, _CMP_UNORD_Q)) << 16;
  if (nan) {
    best = NAN;
    best_col = static_cast<int32_t>(col + __builtin_ctz(nan));
    return;
  }
  const float m = _mm512_reduce_max_ps(_mm512_max_ps(v0, v1));
  if (!(m > best)) return;
  const __m512 mv = _mm512_set1_ps(m);
  const uint32_t eq = static_cast<uint32_t>(_mm512_cmp_ps_mask(v0, mv, _CMP_EQ_OQ)) |
                      static_cast<uint32_t>(_mm512_cmp_ps_mask(v1, mv, _CMP_EQ_OQ)) << 16;
  best = m;
  best_col = static_cast<int32_t>(col + __builtin_ctz(eq));
}
#endif

// A register block's sums, acc[r] holding C panels' columns: stored into y[r, col..col + cols), or with kArgmax
// folded into best[r] / best_col[r].
#if defined(__AVX512F__)
template <int R, int C, bool kArgmax>
inline void store_block(const __m512 (&acc)[R][2 * C], float* y, int64_t N, int64_t col, int64_t cols, float* best,
                        int32_t* best_col) {
#pragma GCC unroll 4
  for (int c = 0; c < C; ++c) {
    const int64_t cc = std::clamp<int64_t>(cols - c * kNR, 0, kNR), cc1 = std::max<int64_t>(cc - 16, 0);
    const __mmask16 m0 = cc >= 16 ? 0xffff : static_cast<__mmask16>((1u << cc) - 1);
    const __mmask16 m1 = cc1 >= 16 ? 0xffff : static_cast<__mmask16>((1u << cc1) - 1);
    for (int r = 0; r < R; ++r) {
      if constexpr (kArgmax) {
        if (cc > 0) fold_best(acc[r][2 * c], acc[r][2 * c + 1], m0, m1, col + c * kNR, best[r], best_col[r]);
      } else {
        _mm512_mask_storeu_ps(y + r * N + col + c * kNR, m0, acc[r][2 * c]);
        _mm512_mask_storeu_ps(y + r * N + col + c * kNR + 16, m1, acc[r][2 * c + 1]);
      }
    }
  }
}
#endif

template <int R, int C, bool kArgmax>
inline void store_block(const float (&acc)[R][C * kNR], float* y, int64_t N, int64_t col, int64_t cols, float* best,
                        int32_t* best_col) {
  for (int r = 0; r < R; ++r) {
    if constexpr (kArgmax) {
      fold_best(acc[r], cols, col, best[r], best_col[r]);
    } else {
      std::memcpy(y + r * N + col, acc[r], cols * sizeof(float));
    }
  }
}

// y[0..R, col..col + cols) = x[0..R, :] @ C consecutive panels starting at `panel` (cols <= C * kNR: only the
// last panel may have fewer real columns), or with kArgmax those sums folded into best[0..R) / best_col[0..R)
// (one entry per row, in column order) instead. `next`, if not null: the first of the next C panels, to prefetch
// into L2 meanwhile, a k-row per k. `col`: the first panel's first column.
template <int R, int C, bool kArgmax>
void block_f32(const float* __restrict x, const float* __restrict panel, float* __restrict y, int64_t K, int64_t N,
               int64_t col, int64_t cols, const float* next, float* best, int32_t* best_col) {
  const int64_t stride = K * kNR;  // floats from one panel to the next
#if defined(__AVX512F__)
  __m512 acc[R][2 * C];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < 2 * C; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m512 b[2 * C];
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
      const float* bc = panel + c * stride + k * kNR;
      // The two cache lines of the k-row kPrefetch floats ahead into L1, and of the next panels' k-row into L2.
      _mm_prefetch(reinterpret_cast<const char*>(bc + kPrefetch), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(bc + kPrefetch + 16), _MM_HINT_T0);
      if (next) {
        _mm_prefetch(reinterpret_cast<const char*>(next + c * stride + k * kNR), _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char*>(next + c * stride + k * kNR + 16), _MM_HINT_T1);
      }
      b[2 * c] = _mm512_loadu_ps(bc);
      b[2 * c + 1] = _mm512_loadu_ps(bc + 16);
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m512 xr = _mm512_set1_ps(x[r * K + k]);
#pragma GCC unroll 4
      for (int j = 0; j < 2 * C; ++j) acc[r][j] = _mm512_fmadd_ps(xr, b[j], acc[r][j]);
    }
  }
  store_block<R, C, kArgmax>(acc, y, N, col, cols, best, best_col);
#else
  (void)next;  // the portable path leaves prefetching to the hardware
  float acc[R][C * kNR] = {};
  for (int64_t k = 0; k < K; ++k) {
    for (int c = 0; c < C; ++c) {
      const float* b = panel + c * stride + k * kNR;
      for (int r = 0; r < R; ++r) {
        const float xr = x[r * K + k];
        // Across the columns only: each acc[r][j] stays one chain over k (no reassociation).
#pragma omp simd
        for (int64_t j = 0; j < kNR; ++j) acc[r][c * kNR + j] += xr * b[j];
      }
    }
  }
  store_block<R, C, kArgmax>(acc, y, N, col, cols, best, best_col);
#endif
}

inline float bf16_to_f32(bf16 v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// block_f32 for bf16 x and bf16 panels [ceil(K / 2), kNR, 2] (see the file's comment): the same register blocks,
// prefetches and epilogue, a vdpbf16ps per k-pair instead of an FMA per k.
template <int R, int C, bool kArgmax>
void block_bf16(const bf16* __restrict x, const bf16* __restrict panel, float* __restrict y, int64_t K, int64_t N,
                int64_t col, int64_t cols, const bf16* next, float* best, int32_t* best_col) {
  const int64_t stride = panel_elems<bf16>(K);  // elements from one panel to the next
#if defined(__AVX512BF16__)
  __m512 acc[R][2 * C];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < 2 * C; ++j) acc[r][j] = _mm512_setzero_ps();
  // One pair-row kk: `pair(r)` is x[r, 2kk] | x[r, 2kk + 1] << 16, the 32 bits broadcast to every lane.
  auto step = [&](int64_t kk, auto pair) __attribute__((always_inline)) {
    __m512bh b[2 * C];
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
      const bf16* bc = panel + c * stride + kk * 2 * kNR;
      _mm_prefetch(reinterpret_cast<const char*>(bc + kPrefetchBf16), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(bc + kPrefetchBf16 + 32), _MM_HINT_T0);
      if (next) {
        _mm_prefetch(reinterpret_cast<const char*>(next + c * stride + kk * 2 * kNR), _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char*>(next + c * stride + kk * 2 * kNR + 32), _MM_HINT_T1);
      }
      b[2 * c] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(bc));
      b[2 * c + 1] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(bc + 32));
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m512bh xr = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int32_t>(pair(r))));
#pragma GCC unroll 4
      for (int j = 0; j < 2 * C; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], xr, b[j]);
    }
  };
  const int64_t pairs = K / 2;
  for (int64_t kk = 0; kk < pairs; ++kk) {
    step(kk, [&](int r) {
      uint32_t v;
      std::memcpy(&v, x + r * K + 2 * kk, sizeof v);
      return v;
    });
  }
  // An odd K's last k: its partner is 0 in x, and the zero padding in the panels.
  if (K % 2) step(pairs, [&](int r) { return static_cast<uint32_t>(x[r * K + K - 1]); });
  store_block<R, C, kArgmax>(acc, y, N, col, cols, best, best_col);
#else
  (void)next;
  float acc[R][C * kNR] = {};
  for (int64_t k = 0; k < K; ++k) {
    for (int c = 0; c < C; ++c) {
      const bf16* b = panel + c * stride + (k / 2) * 2 * kNR + (k % 2);
      for (int r = 0; r < R; ++r) {
        const float xr = bf16_to_f32(x[r * K + k]);
#pragma omp simd
        for (int64_t j = 0; j < kNR; ++j) acc[r][c * kNR + j] += xr * bf16_to_f32(b[2 * j]);
      }
    }
  }
  store_block<R, C, kArgmax>(acc, y, N, col, cols, best, best_col);
#endif
}

template <typename T, int R, int C, bool kArgmax>
void block(const T* x, const T* panel, float* y, int64_t K, int64_t N, int64_t col, int64_t cols, const T* next,
           float* best, int32_t* best_col) {
  if constexpr (std::is_same_v<T, float>) {
    block_f32<R, C, kArgmax>(x, panel, y, K, N, col, cols, next, best, best_col);
  } else {
    block_bf16<R, C, kArgmax>(x, panel, y, K, N, col, cols, next, best, best_col);
  }
}

template <typename T>
using BlockFn = void (*)(const T*, const T*, float*, int64_t, int64_t, int64_t, int64_t, const T*, float*, int32_t*);

template <typename T, int C, bool kArgmax, int... Rs>
constexpr auto make_blocks(std::integer_sequence<int, Rs...>) {
  return std::array<BlockFn<T>, sizeof...(Rs)>{block<T, Rs + 1, C, kArgmax>...};
}
// Blocks<T>::one[a][R - 1] does R rows times one panel, Blocks<T>::wide[a][R - 1] R rows times kWidePanels panels
// (a lone last panel, of an odd count, takes `one`); a = 1: the argmax kernel.
template <typename T>
struct Blocks {
  static constexpr std::array<std::array<BlockFn<T>, kMR>, 2> one = {
      make_blocks<T, 1, false>(std::make_integer_sequence<int, kMR>{}),
      make_blocks<T, 1, true>(std::make_integer_sequence<int, kMR>{})};
  static constexpr std::array<std::array<BlockFn<T>, kWideMR>, 2> wide = {
      make_blocks<T, kWidePanels, false>(std::make_integer_sequence<int, kWideMR>{}),
      make_blocks<T, kWidePanels, true>(std::make_integer_sequence<int, kWideMR>{})};
};

// Rows [row0, row1) times panels [p0, p1) (panel group `grp` for the argmax kernel's partial results).
template <typename T>
void run_item(const Gemm<T>& g, int64_t row0, int64_t row1, int64_t p0, int64_t p1, int64_t grp) {
  const bool argmax = g.y == nullptr;
  const int64_t rows = row1 - row0;
  // Few rows (decode): blocks of up to 12 rows read each panel once. More: blocks of 6 rows x 2 panels, whose
  // rows of x (4 KiB apart when K = 1024, the same set of an 8-way L1) stay in L1; 12 rows then evict each other
  // (bench_cpu_gemm, Zen 4: 0.74-0.96x XLA's dot at M >= 256 with 12 rows, 1.01-1.21x with 6 x 2).
  const bool wide = rows > 2 * kMR;
  const int64_t max_rows = wide ? kWideMR : kMR, max_panels = wide ? kWidePanels : 1;
  const int64_t nblocks = (rows + max_rows - 1) / max_rows;
  const int64_t base = rows / nblocks, extra = rows % nblocks;  // the first `extra` blocks get one more row
  float* best = argmax ? g.best + grp * g.M : nullptr;
  int32_t* best_col = argmax ? g.best_col + grp * g.M : nullptr;
  if (argmax) {
    std::fill(best + row0, best + row1, -INFINITY);
    std::fill(best_col + row0, best_col + row1, static_cast<int32_t>(p0 * kNR));
  }
  for (int64_t p = p0; p < p1;) {
    const int64_t c = std::min(max_panels, p1 - p);  // panels side by side in this block
    const int64_t stride = panel_elems<T>(g.K);
    const T* panel = g.w + p * stride;
    const int64_t col = p * kNR, cols = std::min(c * kNR, g.N - col);
    // The first row block streams the panels from memory and asks for the next ones meanwhile: with 2 or more
    // row blocks per panel, memory then streams while the later blocks compute from L2, instead of idling.
    const T* next = p + c < g.P ? panel + c * stride : nullptr;
    int64_t r = row0;
    for (int64_t b = 0; b < nblocks; ++b) {
      const int64_t n = base + (b < extra ? 1 : 0);
      const BlockFn<T> fn = c > 1 ? Blocks<T>::wide[argmax][n - 1] : Blocks<T>::one[argmax][n - 1];
      fn(g.x + r * g.K, panel, argmax ? nullptr : g.y + r * g.N, g.K, g.N, col, cols, b == 0 ? next : nullptr,
         argmax ? best + r : nullptr, argmax ? best_col + r : nullptr);
      r += n;
    }
    p += c;
  }
}

// One call's work: shared by the calling thread and its helpers (work_queue.h).
template <typename T>
struct Batch {
  Gemm<T> g;
  int64_t groups = 0;
  cbjax_cpu::WorkQueue queue;  // item i: row chunk i / groups, panel group i % groups

  void drain() {
    for (int64_t i; (i = queue.claim()) >= 0;) {
      const int64_t c = i / groups, grp = i % groups;
      const int64_t row0 = c * g.chunk, row1 = std::min(g.M, row0 + g.chunk);
      const int64_t p0 = grp * kPanelsPerItem, p1 = std::min(g.P, p0 + kPanelsPerItem);
      run_item(g, row0, row1, p0, p1, grp);
    }
  }
};

using F32Matrix = ffi::Buffer<ffi::F32, 2>;
using F32Panels = ffi::Buffer<ffi::F32, 3>;
using Bf16Matrix = ffi::Buffer<ffi::BF16, 2>;
using Bf16Panels = ffi::Buffer<ffi::BF16, 4>;  // [P, ceil(K / 2), kNR, 2]
using S32Vector = ffi::Buffer<ffi::S32, 1>;

// The checks every handler shares. On success `rows` is how many leading rows to compute: valid_rows clamped to
// [0, M]; the rows past it are a padded batch's padding (a step's buckets pad 10-20% of a decode step's rows).
template <typename XBuf, typename WBuf>
ffi::Error check(const XBuf& x, const WBuf& w, const S32Vector& valid_rows, int64_t n, int64_t& rows) {
  auto xd = x.dimensions(), wd = w.dimensions();
  constexpr bool kBf16 = std::is_same_v<WBuf, Bf16Panels>;
  if constexpr (kBf16) {
    if (wd[2] != kNR || wd[3] != 2)
      return ffi::Error::InvalidArgument("packed bf16 weights must be [ceil(N / 32), ceil(K / 2), 32, 2]");
    if (wd[1] != (xd[1] + 1) / 2)
      return ffi::Error::InvalidArgument("x [M, K] and the packed bf16 weights [P, ceil(K / 2), 32, 2] differ in K");
  } else {
    if (wd[2] != kNR) return ffi::Error::InvalidArgument("packed weights must be [ceil(N / 32), K, 32]");
    if (wd[1] != xd[1]) return ffi::Error::InvalidArgument("x [M, K] and the packed weights [P, K, 32] differ in K");
  }
  if (n < 0 || wd[0] != (n + kNR - 1) / kNR)
    return ffi::Error::InvalidArgument("the packed weights' panel count is not ceil(n / 32)");
  if (valid_rows.element_count() != 1) return ffi::Error::InvalidArgument("valid_rows must hold one int32");
  rows = std::clamp<int64_t>(valid_rows.typed_data()[0], 0, xd[0]);
  return ffi::Error::Success();
}

// Runs every item of g (g.M rows, K > 0, n > 0) on the calling thread and up to num_threads - 1 pool helpers.
template <typename T>
void run(ffi::ThreadPool& pool, Gemm<T> g, int32_t num_threads) {
  auto batch = std::make_shared<Batch<T>>();
  batch->g = g;
  batch->groups = (g.P + kPanelsPerItem - 1) / kPanelsPerItem;
  const int64_t total = batch->groups * ((g.M + g.chunk - 1) / g.chunk);
  batch->queue.set_total(total);
  int64_t helpers = num_threads > 0 ? num_threads - 1 : pool.num_threads();
  cbjax_cpu::run_on_pool(pool, std::min({helpers, total - 1, g.M * g.K * g.N / kMinWorkPerThread}), batch);
}

template <typename XBuf, typename WBuf>
auto make_gemm(const XBuf& x, const WBuf& w, int64_t rows, int64_t n) {
  using T = std::remove_cv_t<std::remove_pointer_t<decltype(x.typed_data())>>;
  const int64_t K = x.dimensions()[1];
  // A chunk is a whole number of full register blocks, so chunk boundaries do not leave short blocks behind.
  const int64_t row_bytes = std::max<int64_t>(K, 1) * static_cast<int64_t>(sizeof(T));
  const int64_t chunk = std::max<int64_t>(kMR, kChunkBytes / row_bytes / kMR * kMR);
  return Gemm<T>{x.typed_data(), w.typed_data(), nullptr, rows, K, n, w.dimensions()[0], chunk, nullptr, nullptr};
}

template <typename XBuf, typename WBuf>
ffi::Error PackedGemm(ffi::ThreadPool pool, XBuf x, WBuf w, S32Vector valid_rows, int64_t n, int32_t num_threads,
                      ffi::Result<F32Matrix> y) {
  int64_t M;
  if (auto e = check(x, w, valid_rows, n, M); e.failure()) return e;
  auto yd = y->dimensions();
  if (yd[0] != x.dimensions()[0] || yd[1] != n) return ffi::Error::InvalidArgument("the output must be [M, n]");
  if (M < yd[0]) std::memset(y->typed_data() + M * n, 0, (yd[0] - M) * n * sizeof(float));  // padding rows
  if (M == 0 || n == 0) return ffi::Error::Success();
  auto g = make_gemm(x, w, M, n);
  g.y = y->typed_data();
  if (g.K == 0) {
    std::memset(g.y, 0, M * n * sizeof(float));
    return ffi::Error::Success();
  }
  run(pool, g, num_threads);
  return ffi::Error::Success();
}

// argmax over the columns of x @ w, per row, without storing the product (the greedy LM head): the first NaN,
// else the first column of the largest value. Rows past valid_rows get 0.
template <typename XBuf, typename WBuf>
ffi::Error PackedGemmArgmax(ffi::ThreadPool pool, XBuf x, WBuf w, S32Vector valid_rows, int64_t n,
                            int32_t num_threads, ffi::Result<S32Vector> out) {
  int64_t M;
  if (auto e = check(x, w, valid_rows, n, M); e.failure()) return e;
  if (out->element_count() != x.dimensions()[0]) return ffi::Error::InvalidArgument("the output must be [M]");
  if (n == 0) return ffi::Error::InvalidArgument("argmax over zero columns");
  int32_t* idx = out->typed_data();
  std::fill(idx, idx + out->element_count(), 0);
  if (M == 0 || x.dimensions()[1] == 0) return ffi::Error::Success();  // K = 0: all zeros, column 0 wins
  auto g = make_gemm(x, w, M, n);
  const int64_t groups = (g.P + kPanelsPerItem - 1) / kPanelsPerItem;
  std::vector<float> best(groups * M);
  std::vector<int32_t> best_col(groups * M);
  g.best = best.data();
  g.best_col = best_col.data();
  run(pool, g, num_threads);
  // The groups' winners in column order, with the rule of fold_best.
  for (int64_t m = 0; m < M; ++m) {
    float b = best[m];
    int32_t c = best_col[m];
    for (int64_t grp = 1; grp < groups && !std::isnan(b); ++grp) {
      const float v = best[grp * M + m];
      if (std::isnan(v) || v > b) {
        b = v;
        c = best_col[grp * M + m];
      }
    }
    idx[m] = c;
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace cbjax_gemm

#define CBJAX_GEMM_HANDLER(name, fn, XType, WType, RetType)                                                        \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, (fn<XType, WType>), ffi::Ffi::Bind()                                         \
                                                              .Ctx<ffi::ThreadPool>()                              \
                                                              .Arg<XType>()                                        \
                                                              .Arg<WType>()                                        \
                                                              .Arg<cbjax_gemm::S32Vector>()                        \
                                                              .Attr<int64_t>("n")                                  \
                                                              .Attr<int32_t>("num_threads")                        \
                                                              .Ret<RetType>())

// Arguments: x [M, K]; w packed ([ceil(n / 32), K, 32] float32 or [ceil(n / 32), ceil(K / 2), 32, 2] bf16);
// valid_rows [1] (rows past it are zeros, or argmax 0); attributes n (real output columns) and num_threads (<= 0:
// the intra-op pool's size). Returns y [M, n] float32, or the argmax kernels' [M] int32.
CBJAX_GEMM_HANDLER(CbjaxCpuPackedGemm, cbjax_gemm::PackedGemm, cbjax_gemm::F32Matrix, cbjax_gemm::F32Panels,
                   cbjax_gemm::F32Matrix);
CBJAX_GEMM_HANDLER(CbjaxCpuPackedGemmArgmax, cbjax_gemm::PackedGemmArgmax, cbjax_gemm::F32Matrix,
                   cbjax_gemm::F32Panels, cbjax_gemm::S32Vector);
CBJAX_GEMM_HANDLER(CbjaxCpuPackedGemmBf16, cbjax_gemm::PackedGemm, cbjax_gemm::Bf16Matrix, cbjax_gemm::Bf16Panels,
                   cbjax_gemm::F32Matrix);
CBJAX_GEMM_HANDLER(CbjaxCpuPackedGemmArgmaxBf16, cbjax_gemm::PackedGemmArgmax, cbjax_gemm::Bf16Matrix,
                   cbjax_gemm::Bf16Panels, cbjax_gemm::S32Vector);
