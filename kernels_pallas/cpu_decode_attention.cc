// Paged decode attention for CPU: the rows of sequences with q_len 1 (the handler, its threads and the contract's
// checks are in cpu_attention_ffi.cc; the shared primitives in cpu_attention_common.h).
//
// Contract: docs/kernels.md. An item is (decode sequence, kv head): its R = N / K query heads share every K/V row
// it reads; it attends over positions [start, end) = [max(0, kv_len - window), kv_len) of its pages. Two passes
// over the context, page by page: scores of all positions (q . k, R rows at a time), an exact softmax over them
// (no running-max rescales), then p . V accumulated in f32. K and V are each read once; the scores (R x context
// floats) stay in L1/L2. Only positions below kv_len are ever read and only the pages that hold them are looked
// up, so NaN in unused pages, rows past kv_len and garbage page-table entries past the used pages never reach an
// output; page ids are also clamped to [0, P) so a bad table cannot read out of bounds.
//
// Vectorisation: plain loops over H (compile-time for the common head dims) that g++ -O3 -march=native turns
// into AVX-512 (or AVX2) code; reductions are allowed to reassociate by `omp simd` (-fopenmp-simd), and exp is
// a branch-free polynomial so the softmax vectorises too. bf16 is widened to f32 on load by a 16-bit shift, int8
// by a sign extension; an int8 row's scale multiplies its score (K) or its softmax weight (V), never the row.

#include "cpu_attention_common.h"

namespace cbjax_cpu {
namespace {

#ifndef CBJAX_PREFETCH_PAGES
#define CBJAX_PREFETCH_PAGES 2
#endif
constexpr int64_t kPrefetchPages = CBJAX_PREFETCH_PAGES;

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

  // Pass 1: scores s[r * n + (pos - start)] (soft-capped), and their max per query head.
  scratch.m.assign(R, -INFINITY);
  float* __restrict m = scratch.m.data();
  const float cap = p.soft_cap;
  for (int64_t j = it.start / G; j * G < it.end; ++j) {
    const int64_t lo = std::max<int64_t>(it.start, j * G), hi = std::min<int64_t>(it.end, (j + 1) * G);
    const E* kp = kbase + page_of(j) * G * H;
    const float* ks = kscale ? kscale + page_of(j) * G : nullptr;
    prefetch_page(kbase, j + kPrefetchPages);
    if (j + kPrefetchPages > last_page) prefetch_page(vbase, it.start / G + j + kPrefetchPages - last_page - 1);
    for (int64_t pos = lo; pos < hi; ++pos) {
      const E* __restrict krow = kp + (pos - j * G) * H;
      const float row_scale = ks ? ks[pos - j * G] : 1.0f;
      for (int64_t r = 0; r < R; ++r) {
        float x = dot<E, HC>(qs + r * H, krow, H) * row_scale;
        if (cap > 0.0f) x = cap * std::tanh(x / cap);
        s[r * n + (pos - it.start)] = x;
        m[r] = std::max(m[r], x);
      }
    }
  }

  // Softmax numerators in place, exact (the whole row of scores is here): no running-max rescales.
  scratch.l.resize(R);
  float* __restrict inv_sum = scratch.l.data();
  for (int64_t r = 0; r < R; ++r) {
    float* __restrict sr = s + r * n;
    const float mr = m[r];
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; ++i) {
      float e = exp_nonpositive(sr[i] - mr);
      sr[i] = e;
      sum += e;
    }
    inv_sum[r] = 1.0f / sum;  // sum >= 1: the max itself contributes exp(0)
  }
  // int8 V: weight each row's softmax numerator by the row's scale (p * (v * scale) = (p * scale) * v).
  if (vscale) {
    for (int64_t j = it.start / G; j * G < it.end; ++j) {
      const int64_t lo = std::max<int64_t>(it.start, j * G), hi = std::min<int64_t>(it.end, (j + 1) * G);
      const float* __restrict vs = vscale + page_of(j) * G;
      for (int64_t r = 0; r < R; ++r)
        for (int64_t pos = lo; pos < hi; ++pos) s[r * n + (pos - it.start)] *= vs[pos - j * G];
    }
  }

  // Pass 2: acc[r] += p[r, pos] * v[pos], page by page; a page's rows stay in L1 across the R query heads.
  for (int64_t j = it.start / G; j * G < it.end; ++j) {
    const int64_t lo = std::max<int64_t>(it.start, j * G), hi = std::min<int64_t>(it.end, (j + 1) * G);
    const E* vrows = vbase + (page_of(j) * G + (lo - j * G)) * H;
    prefetch_page(vbase, j + kPrefetchPages);
    for (int64_t r = 0; r < R; ++r) {
      accumulate<E, HC>(acc + r * H, s + r * n + (lo - it.start), vrows, hi - lo, H);
    }
  }

  Q* out = static_cast<Q*>(p.out) + (static_cast<int64_t>(it.row) * p.N + kh * R) * H;
  for (int64_t r = 0; r < R; ++r)
    for (int64_t h = 0; h < H; ++h) store(out + r * H + h, acc[r * H + h] * inv_sum[r]);
}

}  // namespace

AttendFn pick_decode(xla::ffi::DataType q, xla::ffi::DataType kv, int64_t H) { return Picker<Decode>::pick(q, kv, H); }

}  // namespace cbjax_cpu
