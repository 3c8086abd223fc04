// Paged decode attention for CPU as an XLA FFI handler (see cpu_attention.py, which builds and registers it).
//
// Contract: docs/kernels.md, the decode half of it. q [T, N, H]; k_pages, v_pages [K, P, G, H]; kv_lens [S];
// page_indices [S, W]; cu_q_lens [S + 1]; num_seqs [1]; k_scales, v_scales: for int8 pages their float32 scales
// [K, P, G, 1] (row (k, p, g) stands for pages[k, p, g] * scales[k, p, g], kv_quant.py), else ignored. For each sequence i < num_seqs whose q_len
// (cu_q_lens[i + 1] - cu_q_lens[i]) is 1, the output row cu_q_lens[i] gets that query's attention (all N heads;
// head n reads kv head n / (N / K)) over positions [max(0, kv_len - window), kv_len) of its pages. Every other
// row (prefill rows, padding) is zero: the Python side fills those from the XLA prefill path.
//
// One work item is (decode sequence, kv head): its R = N / K query heads share every K/V row it reads. Per item,
// two passes over the context, page by page: scores of all positions (q . k, R rows at a time), an exact
// softmax over them (no running-max rescales), then p . V accumulated in f32. K and V are each read once; the
// scores (R x context floats) stay in L1/L2. Only positions below kv_len are ever read and only the pages that
// hold them are looked up, so NaN in unused pages, rows past kv_len and garbage page-table entries past the used
// pages never reach an output; page ids are also clamped to [0, P) so a bad table cannot read out of bounds.
//
// Vectorisation: plain loops over H (compile-time for the common head dims) that g++ -O3 -march=native turns
// into AVX-512 (or AVX2) code; reductions are allowed to reassociate by `omp simd` (-fopenmp-simd), and exp is
// a branch-free polynomial so the softmax vectorises too. bf16 is widened to f32 on load by a 16-bit shift, int8
// by a sign extension; an int8 row's scale multiplies its score (K) or its softmax weight (V), never the row.
//
// Threads: items are taken from an atomic counter by the calling thread and by up to num_threads - 1 helpers
// scheduled on XLA's intra-op thread pool. The caller never waits for a helper that has not started: it does
// the whole batch alone if need be, then waits only for helpers still inside an item, so a busy pool costs
// parallelism, never a deadlock. Helpers that start after the call has finished return at once.

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "xla/ffi/api/ffi.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

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

#ifndef CBJAX_PREFETCH_PAGES
#define CBJAX_PREFETCH_PAGES 2
#endif
constexpr int64_t kPrefetchPages = CBJAX_PREFETCH_PAGES;

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
};

struct Item {
  int32_t seq, row, start, end;  // context positions [start, end)
};

// Per-thread scratch: the item's scaled queries [R, H], scores [R, n] and accumulators [R, H].
struct Scratch {
  std::vector<float> q, s, acc, m, inv_sum;
};

// Q: the dtype of q and the output; E: the dtype of the K/V pages (a float32 model may keep a bfloat16 cache).
template <typename Q, typename E, int HC>
void attend(const Problem& p, const Item& it, int64_t kh, Scratch& scratch) {
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
  scratch.inv_sum.resize(R);
  float* __restrict inv_sum = scratch.inv_sum.data();
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

using AttendFn = void (*)(const Problem&, const Item&, int64_t, Scratch&);

template <typename Q, typename E>
AttendFn pick(int64_t H) {
  switch (H) {
    case 32:
      return attend<Q, E, 32>;
    case 64:
      return attend<Q, E, 64>;
    case 128:
      return attend<Q, E, 128>;
    case 256:
      return attend<Q, E, 256>;
    default:
      return attend<Q, E, 0>;
  }
}

template <typename Q>
AttendFn pick(ffi::DataType kv, int64_t H) {
  if (kv == ffi::DataType::S8) return pick<Q, int8_t>(H);
  return kv == ffi::DataType::F32 ? pick<Q, float>(H) : pick<Q, Bf16>(H);
}

// What the calling thread and its helpers share. Owned jointly (shared_ptr), since a helper may start after the
// call returned; it then sees `closed` and touches nothing else.
struct Batch {
  Problem p;
  AttendFn fn;
  std::vector<Item> items;
  std::atomic<int64_t> next{0};
  std::mutex mu;
  std::condition_variable cv;
  int running = 0;
  bool closed = false;

  void work() {
    Scratch scratch;
    const int64_t total = static_cast<int64_t>(items.size()) * p.K;
    for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < total;) {
      fn(p, items[i / p.K], i % p.K, scratch);
    }
  }

  void help() {
    {
      std::lock_guard<std::mutex> lock(mu);
      if (closed) return;
      ++running;
    }
    work();
    std::lock_guard<std::mutex> lock(mu);
    if (--running == 0) cv.notify_all();
  }
};

// Aliases: a comma inside a template argument list would split the handler macro's arguments.
using I32Vector = ffi::Buffer<ffi::S32, 1>;
using I32Matrix = ffi::Buffer<ffi::S32, 2>;
using F32Buffer = ffi::Buffer<ffi::F32>;

ffi::Error DecodeAttention(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages,
                           I32Vector kv_lens, I32Matrix page_indices, I32Vector cu_q_lens,
                           I32Vector num_seqs, F32Buffer k_scales, F32Buffer v_scales, float sm_scale,
                           float soft_cap, int32_t sliding_window, int32_t num_threads,
                           ffi::Result<ffi::AnyBuffer> out) {
  auto qd = q.dimensions(), kd = k_pages.dimensions(), pd = page_indices.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || v_pages.dimensions().size() != 4)
    return ffi::Error::InvalidArgument("expected q [T, N, H] and k_pages, v_pages [K, P, G, H]");
  const ffi::DataType dt = q.element_type(), kv_dt = k_pages.element_type();
  auto is_float = [](ffi::DataType t) { return t == ffi::DataType::F32 || t == ffi::DataType::BF16; };
  const bool quantized = kv_dt == ffi::DataType::S8;
  if (!is_float(dt) || !(is_float(kv_dt) || quantized))
    return ffi::Error::InvalidArgument("q must be float32 or bfloat16, the K/V pages that or int8");
  if (v_pages.element_type() != kv_dt || out->element_type() != dt)
    return ffi::Error::InvalidArgument("k_pages and v_pages must share a dtype, and the output must have q's");
  auto vd = v_pages.dimensions();
  for (int i = 0; i < 4; ++i)
    if (vd[i] != kd[i]) return ffi::Error::InvalidArgument("k_pages and v_pages differ in shape");
  Problem p;
  p.T = qd[0], p.N = qd[1], p.H = qd[2];
  p.K = kd[0], p.P = kd[1], p.G = kd[2];
  p.S = pd[0], p.W = pd[1];
  if (kd[3] != p.H || p.K <= 0 || p.N % p.K != 0)
    return ffi::Error::InvalidArgument("head dims differ, or N is not a multiple of K");
  if (kv_lens.dimensions()[0] != p.S || cu_q_lens.dimensions()[0] != p.S + 1 || num_seqs.dimensions()[0] < 1)
    return ffi::Error::InvalidArgument("expected kv_lens [S], cu_q_lens [S + 1], num_seqs [1]");
  auto od = out->dimensions();
  if (od.size() != 3 || od[0] != p.T || od[1] != p.N || od[2] != p.H)
    return ffi::Error::InvalidArgument("output must have q's shape");
  p.R = p.N / p.K;
  p.scale = sm_scale;
  p.soft_cap = soft_cap;
  p.window = sliding_window;
  p.q = q.untyped_data();
  p.k = k_pages.untyped_data();
  p.v = v_pages.untyped_data();
  p.k_scales = p.v_scales = nullptr;
  if (quantized) {
    const int64_t rows = p.K * p.P * p.G;
    if (k_scales.element_count() != rows || v_scales.element_count() != rows)
      return ffi::Error::InvalidArgument("int8 pages need k_scales and v_scales [K, P, G, 1]");
    p.k_scales = k_scales.typed_data();
    p.v_scales = v_scales.typed_data();
  }
  p.out = out->untyped_data();
  p.page_indices = page_indices.typed_data();

  std::memset(p.out, 0, out->size_bytes());
  if (p.T == 0 || p.P == 0 || p.G == 0) return ffi::Error::Success();

  auto batch = std::make_shared<Batch>();
  batch->p = p;
  batch->fn = dt == ffi::DataType::F32 ? pick<float>(kv_dt, p.H) : pick<Bf16>(kv_dt, p.H);
  const int32_t* kv = kv_lens.typed_data();
  const int32_t* cu = cu_q_lens.typed_data();
  const int64_t live = std::min<int64_t>(std::max<int32_t>(num_seqs.typed_data()[0], 0), p.S);
  const int64_t max_len = p.W * p.G;
  for (int64_t i = 0; i < live; ++i) {
    const int32_t row = cu[i];
    if (cu[i + 1] - row != 1 || row < 0 || row >= p.T) continue;
    const int32_t end = static_cast<int32_t>(std::min<int64_t>(std::max(kv[i], 0), max_len));
    const int32_t start = p.window > 0 ? std::max(end - p.window, 0) : 0;
    if (end > start) batch->items.push_back({static_cast<int32_t>(i), row, start, end});  // else: zeros
  }
  if (batch->items.empty()) return ffi::Error::Success();

  const int64_t total = static_cast<int64_t>(batch->items.size()) * p.K;
  int64_t helpers = num_threads > 0 ? num_threads - 1 : pool.num_threads();
  helpers = std::min(helpers, total - 1);
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([batch] { batch->help(); });
  batch->work();
  std::unique_lock<std::mutex> lock(batch->mu);
  batch->closed = true;
  batch->cv.wait(lock, [&] { return batch->running == 0; });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(CbjaxCpuDecodeAttention, DecodeAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()            // q [T, N, H]
                                  .Arg<ffi::AnyBuffer>()            // k_pages [K, P, G, H]
                                  .Arg<ffi::AnyBuffer>()            // v_pages [K, P, G, H]
                                  .Arg<I32Vector>()                 // kv_lens [S]
                                  .Arg<I32Matrix>()                 // page_indices [S, W]
                                  .Arg<I32Vector>()                 // cu_q_lens [S + 1]
                                  .Arg<I32Vector>()                 // num_seqs [1]
                                  .Arg<F32Buffer>()                 // k_scales [K, P, G, 1] (int8 pages)
                                  .Arg<F32Buffer>()                 // v_scales
                                  .Attr<float>("sm_scale")
                                  .Attr<float>("soft_cap")          // <= 0: none
                                  .Attr<int32_t>("sliding_window")  // <= 0: none
                                  .Attr<int32_t>("num_threads")     // <= 0: the intra-op pool's size
                                  .Ret<ffi::AnyBuffer>()            // out [T, N, H], q's dtype
);
