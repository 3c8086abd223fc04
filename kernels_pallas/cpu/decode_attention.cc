// Paged decode attention for CPU: the rows of sequences with q_len 1 (the handler, its threads and the contract's
// checks are in attention_ffi.cc; the shared primitives in attention_common.h).
//
// Contract: docs/kernels.md. An item is (decode sequence, kv head): its R = N / K query heads share every K/V row
// it reads; it attends over positions [start, end) = [max(0, kv_len - window), kv_len) of its pages. Two passes
// over the context, page by page: scores of all positions (q . k, R rows at a time), an exact softmax over them
// (no running-max rescales), then p . V accumulated in f32. K and V are each read once; the scores (R x context
// floats) stay in L1/L2. Only positions below kv_len are ever read and only the pages that hold them are looked
// up, so NaN in unused pages, rows past kv_len and garbage page-table entries past the used pages never reach an
// output; page ids are also clamped to [0, P) so a bad table cannot read out of bounds.
//
// Vectorisation: with AVX-512 and a head dim that is a multiple of 16, scores come 16 positions to a vector (a
// transpose-add tree per head, or partial transposes of K shared by the heads: sum_lanes16, QuadScores) and p . V
// keeps groups of heads' accumulators in registers across the pages (accumulate_heads); docs/kernels.md has
// the measurements. Otherwise plain loops over H that g++ -O3 -march=native vectorises, reductions allowed to
// reassociate by `omp simd` (-fopenmp-simd). exp is a branch-free polynomial so the softmax vectorises too. bf16
// is widened to f32 on load by a 16-bit shift, int8 by a sign extension; an int8 row's scale multiplies its score
// (K) or its softmax weight (V), never the row.

#include "attention_common.h"

namespace cbjax_cpu {
namespace {

#ifndef CBJAX_PREFETCH_PAGES
#define CBJAX_PREFETCH_PAGES 2
#endif
constexpr int64_t kPrefetchPages = CBJAX_PREFETCH_PAGES;

#if defined(__AVX512F__)
// Lane i of the result is the sum of the 16 lanes of x[i]: a transpose-add tree (unpack within 128-bit lanes,
// then 128-bit shuffles), 15 adds and 30 shuffles for 16 sums instead of ~8 shuffles and adds for each one.
inline __m512 sum_lanes16(const __m512 x[16]) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)  // lane quad L of a[i]: partial sums of x[2i], x[2i+1], x[2i], x[2i+1] over quad L
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(x[2 * i], x[2 * i + 1]), _mm512_unpackhi_ps(x[2 * i], x[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // quad L of b[i]: partial sums of x[4i .. 4i+3] over quad L
    const __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(a[2 * i]), _mm512_castps_pd(a[2 * i + 1]));
    const __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(a[2 * i]), _mm512_castps_pd(a[2 * i + 1]));
    b[i] = _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));
  }
  for (int i = 0; i < 2; ++i)  // quads of c[i]: x[8i .. 8i+3] over quads 0+1, 2+3, then x[8i+4 .. 8i+7] likewise
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// The scores q . k[t] of `count` <= 16 consecutive K rows (row stride HC) in the lanes of one vector; lanes past
// `count` are 0 and their rows are never read (they may be past kv_len, NaN). kFull: count is 16 (no per-row test).
template <typename E, int HC, bool kFull>
inline __m512 scores16(const float* __restrict q, const E* __restrict k, int64_t count) {
  constexpr int C = HC / 16;
  __m512 qv[C];
  for (int c = 0; c < C; ++c) qv[c] = _mm512_loadu_ps(q + 16 * c);
  __m512 x[16];
  for (int t = 0; t < 16; ++t) {
    if (kFull || t < count) {
      __m512 a = _mm512_mul_ps(qv[0], load16(k + t * HC));
      for (int c = 1; c < C; ++c) a = _mm512_fmadd_ps(qv[c], load16(k + t * HC + 16 * c), a);
      x[t] = a;
    } else {
      x[t] = _mm512_setzero_ps();
    }
  }
  return sum_lanes16(x);
}

// The scores of query heads over a block of `count` <= 16 consecutive K rows (row stride HC, lanes past `count`
// 0, their rows never read), with the first two stages of a 16 x 16 transpose done on the K block once for all
// heads instead of a whole transpose-add tree per head (sum_lanes16: 30 shuffles a head). After them, quad L of
// u[c][4i + j] holds column 16c + 4L + j of rows 4i .. 4i+3; a head multiplies it by qp[c][j] (quad L: that
// column of q, 4 times), sums over (c, j) and then over the 4 quads (6 shuffles a head). For R query heads the
// shuffles per block are 32 HC / 16 + 6 R instead of 30 R.
template <typename E, int HC>
struct QuadScores {
  static constexpr int C = HC / 16;
  alignas(64) float u[C][16][16];

  // qp [C][4][16] for one head from its q row (scaled): lane 4L + m of qp[c][j] is q[16c + 4L + j].
  static void permute_q(const float* q, float* qp) {
    for (int c = 0; c < C; ++c) {
      const __m512 qc = _mm512_loadu_ps(q + 16 * c);
      for (int j = 0; j < 4; ++j) {
        const __m512i idx = _mm512_add_epi32(
            _mm512_set_epi32(12, 12, 12, 12, 8, 8, 8, 8, 4, 4, 4, 4, 0, 0, 0, 0), _mm512_set1_epi32(j));
        _mm512_store_ps(qp + (c * 4 + j) * 16, _mm512_permutexvar_ps(idx, qc));
      }
    }
  }

  void load(const E* __restrict k, int64_t count) {
    for (int c = 0; c < C; ++c) {
      __m512 x[16], t[16];
      for (int r = 0; r < 16; ++r) x[r] = r < count ? load16(k + r * HC + 16 * c) : _mm512_setzero_ps();
      for (int i = 0; i < 8; ++i) {
        t[2 * i] = _mm512_unpacklo_ps(x[2 * i], x[2 * i + 1]);  // quad L: a0 b0 a1 b1 (columns 4L + 0, 1)
        t[2 * i + 1] = _mm512_unpackhi_ps(x[2 * i], x[2 * i + 1]);  // a2 b2 a3 b3
      }
      for (int i = 0; i < 4; ++i) {
        const __m512d t0 = _mm512_castps_pd(t[4 * i]), t1 = _mm512_castps_pd(t[4 * i + 1]);
        const __m512d t2 = _mm512_castps_pd(t[4 * i + 2]), t3 = _mm512_castps_pd(t[4 * i + 3]);
        _mm512_store_ps(u[c][4 * i], _mm512_castpd_ps(_mm512_unpacklo_pd(t0, t2)));  // a0 b0 c0 d0
        _mm512_store_ps(u[c][4 * i + 1], _mm512_castpd_ps(_mm512_unpackhi_pd(t0, t2)));
        _mm512_store_ps(u[c][4 * i + 2], _mm512_castpd_ps(_mm512_unpacklo_pd(t1, t3)));
        _mm512_store_ps(u[c][4 * i + 3], _mm512_castpd_ps(_mm512_unpackhi_pd(t1, t3)));
      }
    }
  }

  // Lane t: the score of row t for the head whose permuted q is qp.
  __m512 scores(const float* __restrict qp) const {
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int c = 0; c < C; ++c)
      for (int j = 0; j < 4; ++j) {
        const __m512 qv = _mm512_load_ps(qp + (c * 4 + j) * 16);
        for (int i = 0; i < 4; ++i) acc[i] = _mm512_fmadd_ps(_mm512_load_ps(u[c][4 * i + j]), qv, acc[i]);
      }
    // acc[i] quad L: rows 4i .. 4i+3 over the columns of quad L; sum the quads and put row 4i + m in lane 4i + m.
    const __m512 c0 = _mm512_add_ps(_mm512_shuffle_f32x4(acc[0], acc[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_f32x4(acc[0], acc[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512 c1 = _mm512_add_ps(_mm512_shuffle_f32x4(acc[2], acc[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_f32x4(acc[2], acc[3], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(c0, c1, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(c0, c1, _MM_SHUFFLE(3, 1, 3, 1)));
  }
};

// acc[r, :HC] += sum over the item's positions t of w[r * w_stride + t] * v[t, :HC] for the RB query heads r of
// a group, walking pages first_page .. last_page (page(j, v, t0, count): page j's first row used, its position
// t0 - start, how many rows). Each V row is loaded once for all RB heads and the RB x HC / 16 accumulators stay
// in registers for the whole context; with at most 8 of them, even and odd rows go to two sets so that the FMA
// latency does not bound the loop.
template <typename E, int HC, int RB, typename Page>
inline void accumulate_heads(float* __restrict acc, const float* __restrict w, int64_t w_stride,
                             int64_t first_page, int64_t last_page, Page page) {
  constexpr int C = HC / 16;
  constexpr int U = RB * C <= 8 ? 2 : 1;
  __m512 a[U][RB][C];
  for (int u = 0; u < U; ++u)
    for (int r = 0; r < RB; ++r)
      for (int c = 0; c < C; ++c) a[u][r][c] = _mm512_setzero_ps();
  for (int64_t j = first_page; j <= last_page; ++j) {
    const E* v;
    int64_t t0, count;
    page(j, v, t0, count);
    const float* __restrict wj = w + t0;
    auto row = [&](int u, int64_t t) {
      __m512 x[C];
      for (int c = 0; c < C; ++c) x[c] = load16(v + t * HC + 16 * c);
      for (int r = 0; r < RB; ++r) {
        const __m512 wt = _mm512_set1_ps(wj[r * w_stride + t]);
        for (int c = 0; c < C; ++c) a[u][r][c] = _mm512_fmadd_ps(wt, x[c], a[u][r][c]);
      }
    };
    int64_t t = 0;
    for (; t + U <= count; t += U)
      for (int u = 0; u < U; ++u) row(u, t + u);
    for (; t < count; ++t) row(0, t);
  }
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < C; ++c) {
      for (int u = 1; u < U; ++u) a[0][r][c] = _mm512_add_ps(a[0][r][c], a[u][r][c]);
      _mm512_storeu_ps(acc + r * HC + 16 * c, a[0][r][c]);
    }
}
#endif

// max(x[0 .. n)): g++ keeps an `omp simd` max reduction scalar (a chain of vmaxss), which cost as much as pass 1.
inline float max_of(const float* __restrict x, int64_t n) {
#if defined(__AVX512F__)
  __m512 m = _mm512_set1_ps(-INFINITY);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(x + i));
  if (i < n) m = _mm512_max_ps(m, _mm512_mask_loadu_ps(m, static_cast<__mmask16>((1u << (n - i)) - 1u), x + i));
  return _mm512_reduce_max_ps(m);
#else
  float m = -INFINITY;
  for (int64_t i = 0; i < n; ++i) m = std::max(m, x[i]);
  return m;
#endif
}

// Soft-capped (cap > 0) scores [R, n] turned into exact softmax numerators in place, row by row (the whole row of
// scores is here: no running-max rescales); inv_sum[r] = 1 / row r's sum (>= 1: the max contributes exp(0)).
inline void softmax_numerators(float* __restrict s, int64_t R, int64_t n, float cap, float* __restrict inv_sum) {
  if (cap > 0.0f)
    for (int64_t i = 0; i < R * n; ++i) s[i] = cap * std::tanh(s[i] / cap);
  for (int64_t r = 0; r < R; ++r) {
    float* __restrict sr = s + r * n;
    const float mr = max_of(sr, n);
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; ++i) {
      float e = exp_nonpositive(sr[i] - mr);
      sr[i] = e;
      sum += e;
    }
    inv_sum[r] = 1.0f / sum;
  }
}

// Q: the dtype of q and the output; E: the dtype of the K/V pages (a float32 model may keep a bfloat16 cache).
template <typename Q, typename E, int HC>
struct Decode {
  static void run(const Problem& p, const Item& it, int64_t kh, Scratch& scratch);
};

template <typename Q, typename E, int HC>
void Decode<Q, E, HC>::run(const Problem& p, const Item& it, int64_t kh, Scratch& scratch) {
  const int64_t H = HC > 0 ? HC : p.H;
  const int64_t R = p.R, G = p.G;
  const int64_t n = it.end - it.start;
#if defined(__AVX512F__)
  // Scores 16 positions per vector and register-resident accumulators for groups of query heads (below).
  constexpr bool kVectorRows = HC > 0 && HC % 16 == 0;
#endif
  scratch.q.resize(R * H);
  scratch.acc.assign(R * H, 0.0f);
  scratch.s.resize(std::max<int64_t>(R * n, 1));
  float* __restrict qs = scratch.q.data();
  float* __restrict acc = scratch.acc.data();
  float* __restrict s = scratch.s.data();

  const Q* q = static_cast<const Q*>(p.q) + (static_cast<int64_t>(it.row) * p.N + kh * R) * H;
  for (int64_t i = 0; i < R * H; ++i) qs[i] = load(q[i]) * p.scale;

  const E* kbase = static_cast<const E*>(p.k) + kh * p.P * G * H;
  const E* vbase = static_cast<const E*>(p.v) + kh * p.P * G * H;
  const float* kscale = p.k_scales ? p.k_scales + kh * p.P * G : nullptr;  // row scales of kv head kh
  const float* vscale = p.v_scales ? p.v_scales + kh * p.P * G : nullptr;
  const int32_t* table = p.page_indices + static_cast<int64_t>(it.seq) * p.W;
  auto page_of = [&](int64_t j) -> int64_t {
    int64_t page = table[j];
    return std::min<int64_t>(std::max<int64_t>(page, 0), p.P - 1);
  };

  // Pages sit anywhere in the pool, so the hardware prefetcher cannot run ahead across them: each pass asks for
  // the page kPrefetchPages ahead while it computes on the current one (only pages below `end`: the table's
  // later entries are never read).
  const int64_t last_page = (it.end - 1) / G;
  const int64_t page_bytes = G * H * static_cast<int64_t>(sizeof(E));
  auto prefetch_page = [&](const E* base, int64_t j) {
    if (j > last_page) return;
    const char* a = reinterpret_cast<const char*>(base + page_of(j) * G * H);
    for (int64_t b = 0; b < page_bytes; b += 64) __builtin_prefetch(a + b, 0, 3);
  };
  for (int64_t d = 0; d < kPrefetchPages; ++d) prefetch_page(kbase, it.start / G + d);

  // Pass 1: scores s[r * n + (pos - start)] (int8 rows times their scale, then soft-capped).
#if defined(__AVX512F__)
  // Shared partial transposes of K (QuadScores) when they take fewer shuffles than a tree per head.
  const bool quad = kVectorRows && 32 * (HC / 16) < 24 * R;
  QuadScores<E, kVectorRows ? HC : 16> quad_block;
  float* qp = nullptr;
  if (quad) {
    scratch.m.resize(R * H * 4 + 16);  // the permuted q rows, 64-byte aligned
    qp = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(scratch.m.data()) + 63) & ~uintptr_t{63});
    for (int64_t r = 0; r < R; ++r) decltype(quad_block)::permute_q(qs + r * H, qp + r * H * 4);
  }
#endif
  const float cap = p.soft_cap;
  for (int64_t j = it.start / G; j * G < it.end; ++j) {
    const int64_t lo = std::max<int64_t>(it.start, j * G), hi = std::min<int64_t>(it.end, (j + 1) * G);
    const E* kp = kbase + page_of(j) * G * H;
    const float* ks = kscale ? kscale + page_of(j) * G : nullptr;
    prefetch_page(kbase, j + kPrefetchPages);
    if (j + kPrefetchPages > last_page) prefetch_page(vbase, it.start / G + j + kPrefetchPages - last_page - 1);
#if defined(__AVX512F__)
    if constexpr (kVectorRows) {
      // 16 positions at a time across the lanes; the R query heads reuse each block of K rows from L1.
      for (int64_t b = lo; b < hi; b += 16) {
        const int64_t count = std::min<int64_t>(16, hi - b);
        const __mmask16 lanes = static_cast<__mmask16>((1u << count) - 1u);
        const E* krows = kp + (b - j * G) * H;
        const __m512 row_scale =
            ks ? _mm512_maskz_loadu_ps(lanes, ks + (b - j * G)) : _mm512_set1_ps(1.0f);
        if (quad) {
          quad_block.load(krows, count);
          for (int64_t r = 0; r < R; ++r)
            _mm512_mask_storeu_ps(s + r * n + (b - it.start), lanes,
                                  _mm512_mul_ps(quad_block.scores(qp + r * HC * 4), row_scale));
          continue;
        }
        for (int64_t r = 0; r < R; ++r) {
          const __m512 sc = count == 16 ? scores16<E, HC, true>(qs + r * H, krows, 16)
                                        : scores16<E, HC, false>(qs + r * H, krows, count);
          const __m512 x = _mm512_mul_ps(sc, row_scale);
          _mm512_mask_storeu_ps(s + r * n + (b - it.start), lanes, x);
        }
      }
      continue;
    }
#endif
    for (int64_t pos = lo; pos < hi; ++pos) {
      const E* __restrict krow = kp + (pos - j * G) * H;
      const float row_scale = ks ? ks[pos - j * G] : 1.0f;
      for (int64_t r = 0; r < R; ++r) s[r * n + (pos - it.start)] = dot<E, HC>(qs + r * H, krow, H) * row_scale;
    }
  }
  scratch.l.resize(R);
  float* __restrict inv_sum = scratch.l.data();
  softmax_numerators(s, R, n, cap, inv_sum);
  // int8 V: weight each row's softmax numerator by the row's scale (p * (v * scale) = (p * scale) * v).
  if (vscale) {
    for (int64_t j = it.start / G; j * G < it.end; ++j) {
      const int64_t lo = std::max<int64_t>(it.start, j * G), hi = std::min<int64_t>(it.end, (j + 1) * G);
      const float* __restrict vs = vscale + page_of(j) * G;
      for (int64_t r = 0; r < R; ++r)
        for (int64_t pos = lo; pos < hi; ++pos) s[r * n + (pos - it.start)] *= vs[pos - j * G];
    }
  }

  // Pass 2: acc[r] += p[r, pos] * v[pos].
#if defined(__AVX512F__)
  if constexpr (kVectorRows) {
    // Query heads in groups whose accumulators fit in registers (at most 16 zmm), each walking all the pages (one
    // group for R x H <= 256: V is read once).
    const int64_t first_page = it.start / G;
    auto page = [&](int64_t j, const E*& v, int64_t& t0, int64_t& count) {
      const int64_t lo = std::max<int64_t>(it.start, j * G), hi = std::min<int64_t>(it.end, (j + 1) * G);
      v = vbase + (page_of(j) * G + (lo - j * G)) * H;
      t0 = lo - it.start;
      count = hi - lo;
      prefetch_page(vbase, j + kPrefetchPages);
    };
    constexpr int kMaxGroup = std::max(1, std::min(8, 16 / (HC / 16)));
    for (int64_t r = 0; r < R;) {
      const int64_t left = std::min<int64_t>(R - r, kMaxGroup);
      float* a = acc + r * H;
      const float* w = s + r * n;
      if (left >= 8) {
        accumulate_heads<E, HC, (kMaxGroup >= 8 ? 8 : 1)>(a, w, n, first_page, last_page, page);
        r += kMaxGroup >= 8 ? 8 : 1;
      } else if (left >= 4) {
        accumulate_heads<E, HC, 4>(a, w, n, first_page, last_page, page);
        r += 4;
      } else if (left >= 2) {
        accumulate_heads<E, HC, 2>(a, w, n, first_page, last_page, page);
        r += 2;
      } else {
        accumulate_heads<E, HC, 1>(a, w, n, first_page, last_page, page);
        r += 1;
      }
    }
  } else
#endif
  {
    // Page by page; a page's rows stay in L1 across the R query heads.
    for (int64_t j = it.start / G; j * G < it.end; ++j) {
      const int64_t lo = std::max<int64_t>(it.start, j * G), hi = std::min<int64_t>(it.end, (j + 1) * G);
      const E* vrows = vbase + (page_of(j) * G + (lo - j * G)) * H;
      prefetch_page(vbase, j + kPrefetchPages);
      for (int64_t r = 0; r < R; ++r) accumulate<E, HC>(acc + r * H, s + r * n + (lo - it.start), vrows, hi - lo, H);
    }
  }

  Q* out = static_cast<Q*>(p.out) + (static_cast<int64_t>(it.row) * p.N + kh * R) * H;
  for (int64_t r = 0; r < R; ++r)
    for (int64_t h = 0; h < H; ++h) store(out + r * H + h, acc[r * H + h] * inv_sum[r]);
}

#if defined(__AVX512BF16__)
// Decode over bf16 pages with AVX512-BF16's dot products (the handler's `bf16_dots`: q and the softmax weights
// rounded to bf16, as a bf16 model's matmul inputs are; products exact in f32, sums in f32). vdpbf16ps(acc, a, b)
// adds a[2i] b[2i] + a[2i + 1] b[2i + 1] to lane i, so
//   q . k: the bf16 q row against a K row as it lies in the page (pairs of adjacent h), HC / 32 instructions per
//          row and head instead of HC / 16 FMAs and the widening of every K element; the 16 lanes of 16 rows are
//          summed by sum_lanes16 as in Decode;
//   p . V: two V rows t, t + 1 interleaved element by element (vpunpck{l,h}wd: within each 128-bit lane, h 0..3
//          and 4..7 of the lane's 8) against the pair (p[t], p[t + 1]) broadcast, HC / 32 instructions per row
//          pair per head (x 2 for the lo and hi halves) instead of HC / 16 FMAs per row; the accumulators hold h
//          in that interleaved order and are put back in order once per item.
// Rows pair up within a page (a page's last odd row pairs with a zero row of weight 0: the row past it may be NaN
// or another sequence's). Every output is one fixed chain of instructions per item: deterministic, independent of
// the thread count.
template <typename Q, int HC>
struct DecodeBf16Dots {
  static_assert(HC % 32 == 0, "bf16 dots need HC a multiple of 32");
  static constexpr int C = HC / 32;  // zmm of 32 bf16 per row

  static void run(const Problem& p, const Item& it, int64_t kh, Scratch& scratch);
};

template <typename Q, int HC>
void DecodeBf16Dots<Q, HC>::run(const Problem& p, const Item& it, int64_t kh, Scratch& scratch) {
  constexpr int64_t H = HC;
  const int64_t R = p.R, G = p.G;
  const int64_t n = it.end - it.start;
  // q rows rounded to bf16 (unscaled: a bf16 q is kept exactly; the scale multiplies the scores), then the
  // softmax weights in bf16 [R, n + 1] (one spare for a pair's zero partner), both in scratch.q's floats.
  scratch.q.resize(R * H / 2 + (R * (n + 1) + 1) / 2 + 16);
  scratch.s.resize(std::max<int64_t>(R * n, 1));
  scratch.acc.resize(R * H);
  uint16_t* qb = reinterpret_cast<uint16_t*>(scratch.q.data());
  uint16_t* pb = qb + R * H;
  float* __restrict s = scratch.s.data();

  const Q* q = static_cast<const Q*>(p.q) + (static_cast<int64_t>(it.row) * p.N + kh * R) * H;
  for (int64_t i = 0; i < R * H; ++i) {
    Bf16 b;
    store(&b, load(q[i]));
    qb[i] = b.bits;
  }
  const Bf16* kbase = static_cast<const Bf16*>(p.k) + kh * p.P * G * H;
  const Bf16* vbase = static_cast<const Bf16*>(p.v) + kh * p.P * G * H;
  const int32_t* table = p.page_indices + static_cast<int64_t>(it.seq) * p.W;
  auto page_of = [&](int64_t j) -> int64_t { return std::min<int64_t>(std::max<int64_t>(table[j], 0), p.P - 1); };
  const int64_t last_page = (it.end - 1) / G;
  const int64_t page_bytes = G * H * static_cast<int64_t>(sizeof(Bf16));
  auto prefetch_page = [&](const Bf16* base, int64_t j) {
    if (j > last_page) return;
    const char* a = reinterpret_cast<const char*>(base + page_of(j) * G * H);
    for (int64_t b = 0; b < page_bytes; b += 64) __builtin_prefetch(a + b, 0, 3);
  };
  for (int64_t d = 0; d < kPrefetchPages; ++d) prefetch_page(kbase, it.start / G + d);

  // Pass 1: s[r * n + (pos - start)] = scale * (q_r . k_pos), 16 positions per vector.
  const __m512 scale = _mm512_set1_ps(p.scale);
  for (int64_t j = it.start / G; j * G < it.end; ++j) {
    const int64_t lo = std::max<int64_t>(it.start, j * G), hi = std::min<int64_t>(it.end, (j + 1) * G);
    const Bf16* kp = kbase + page_of(j) * G * H;
    prefetch_page(kbase, j + kPrefetchPages);
    if (j + kPrefetchPages > last_page) prefetch_page(vbase, it.start / G + j + kPrefetchPages - last_page - 1);
    for (int64_t b = lo; b < hi; b += 16) {
      const int64_t count = std::min<int64_t>(16, hi - b);
      const __mmask16 lanes = static_cast<__mmask16>((1u << count) - 1u);
      const Bf16* krows = kp + (b - j * G) * H;
      for (int64_t r = 0; r < R; ++r) {
        __m512bh qv[C];
        for (int c = 0; c < C; ++c) qv[c] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(qb + r * H + 32 * c));
        __m512 x[16];
        for (int t = 0; t < 16; ++t) {
          x[t] = _mm512_setzero_ps();
          if (t < count)
            for (int c = 0; c < C; ++c)
              x[t] = _mm512_dpbf16_ps(x[t], qv[c],
                                      reinterpret_cast<__m512bh>(_mm512_loadu_si512(krows + t * H + 32 * c)));
        }
        _mm512_mask_storeu_ps(s + r * n + (b - it.start), lanes, _mm512_mul_ps(sum_lanes16(x), scale));
      }
    }
  }
  // Softmax numerators, rounded to bf16 into pb [R, n + 1]; the sums (of the f32 numerators) in scratch.l.
  scratch.l.resize(R);
  float* __restrict inv_sum = scratch.l.data();
  softmax_numerators(s, R, n, p.soft_cap, inv_sum);
  for (int64_t r = 0; r < R; ++r) {
    const float* __restrict sr = s + r * n;
    uint16_t* pr = pb + r * (n + 1);
    for (int64_t i = 0; i < n; ++i) {
      Bf16 b;
      store(&b, sr[i]);
      pr[i] = b.bits;
    }
    pr[n] = 0;
  }

  // Pass 2: heads in groups of up to kGroup, their 2 C accumulators each in registers across all the pages.
  constexpr int kGroup = std::max(1, std::min(8, 16 / (2 * C)));
  float* __restrict acc = scratch.acc.data();
  for (int64_t r0 = 0; r0 < R; r0 += kGroup) {
    const int64_t rb = std::min<int64_t>(kGroup, R - r0);
    __m512 a[kGroup][2 * C];
    for (int r = 0; r < kGroup; ++r)
      for (int c = 0; c < 2 * C; ++c) a[r][c] = _mm512_setzero_ps();
    auto pair = [&](const Bf16* v0, const Bf16* v1, int64_t t, bool second) {
      __m512i x[2 * C];
      for (int c = 0; c < C; ++c) {
        const __m512i e = _mm512_loadu_si512(v0 + 32 * c);
        const __m512i o = second ? _mm512_loadu_si512(v1 + 32 * c) : _mm512_setzero_si512();
        x[2 * c] = _mm512_unpacklo_epi16(e, o);
        x[2 * c + 1] = _mm512_unpackhi_epi16(e, o);
      }
      for (int r = 0; r < kGroup; ++r) {
        if (r >= rb) break;
        uint32_t w;  // (p[t], p[t + 1]) of head r0 + r; pb's spare slot makes the partner 0 at the end
        std::memcpy(&w, pb + (r0 + r) * (n + 1) + t, sizeof w);
        if (!second) w &= 0xffffu;
        const __m512bh wv = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int32_t>(w)));
        for (int c = 0; c < 2 * C; ++c) a[r][c] = _mm512_dpbf16_ps(a[r][c], wv, reinterpret_cast<__m512bh>(x[c]));
      }
    };
    for (int64_t j = it.start / G; j * G < it.end; ++j) {
      const int64_t lo = std::max<int64_t>(it.start, j * G), hi = std::min<int64_t>(it.end, (j + 1) * G);
      const Bf16* vrows = vbase + (page_of(j) * G + (lo - j * G)) * H;
      prefetch_page(vbase, j + kPrefetchPages);
      const int64_t t0 = lo - it.start, count = hi - lo;
      int64_t t = 0;
      for (; t + 2 <= count; t += 2) pair(vrows + t * H, vrows + (t + 1) * H, t0 + t, true);
      if (t < count) pair(vrows + t * H, nullptr, t0 + t, false);
    }
    // Lane 4L + i of a[r][2c] is h = 32c + 8L + i, of a[r][2c + 1] h = 32c + 8L + 4 + i (i < 4).
    for (int64_t r = 0; r < rb; ++r)
      for (int c = 0; c < C; ++c) {
        alignas(64) float lo_h[16], hi_h[16];
        _mm512_store_ps(lo_h, a[r][2 * c]);
        _mm512_store_ps(hi_h, a[r][2 * c + 1]);
        float* dst = acc + (r0 + r) * H + 32 * c;
        for (int L = 0; L < 4; ++L)
          for (int i = 0; i < 4; ++i) {
            dst[8 * L + i] = lo_h[4 * L + i];
            dst[8 * L + 4 + i] = hi_h[4 * L + i];
          }
      }
  }

  Q* out = static_cast<Q*>(p.out) + (static_cast<int64_t>(it.row) * p.N + kh * R) * H;
  for (int64_t r = 0; r < R; ++r)
    for (int64_t h = 0; h < H; ++h) store(out + r * H + h, acc[r * H + h] * inv_sum[r]);
}
#endif

}  // namespace

AttendFn pick_decode(xla::ffi::DataType q, xla::ffi::DataType kv, int64_t H) { return Picker<Decode>::pick(q, kv, H); }

AttendFn pick_decode_bf16_dots(xla::ffi::DataType q, xla::ffi::DataType kv, int64_t H) {
#if defined(__AVX512BF16__)
  if (kv != xla::ffi::DataType::BF16) return nullptr;
  const bool f32 = q == xla::ffi::DataType::F32;
  switch (H) {
    case 32:
      return f32 ? DecodeBf16Dots<float, 32>::run : DecodeBf16Dots<Bf16, 32>::run;
    case 64:
      return f32 ? DecodeBf16Dots<float, 64>::run : DecodeBf16Dots<Bf16, 64>::run;
    case 128:
      return f32 ? DecodeBf16Dots<float, 128>::run : DecodeBf16Dots<Bf16, 128>::run;
    case 256:
      return f32 ? DecodeBf16Dots<float, 256>::run : DecodeBf16Dots<Bf16, 256>::run;
    default:
      return nullptr;
  }
#else
  (void)q, (void)kv, (void)H;
  return nullptr;
#endif
}

}  // namespace cbjax_cpu
