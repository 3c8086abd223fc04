// Ragged paged attention for CPU as one XLA FFI handler (library.py builds and registers it; attention.py calls it).
//
// Contract: docs/kernels.md. q [T, N, H]; k_pages, v_pages [K, P, G, H]; kv_lens [S]; page_indices [S, W];
// cu_q_lens [S + 1]; num_seqs [1]; k_scales, v_scales: for int8 pages their float32 scales [K, P, G, 1] (row
// (k, p, g) stands for pages[k, p, g] * scales[k, p, g], kv_quant.py), else ignored. Sequence i < num_seqs owns
// the rows cu_q_lens[i] .. cu_q_lens[i + 1], the last q_len tokens of its kv_len context; head n reads kv head
// n / (N / K). `rows` says which sequences this call fills: 1 those with q_len 1 (decode,
// decode_attention.cc), 2 those with q_len > 1 (prefill, prefill_attention.cc), 3 both. Every other row
// (the other kind, padding, sequences >= num_seqs, empty contexts) is zero.
//
// Work items: (decode sequence, kv head) and (prefill sequence, block of query rows, kv head). They are sorted by
// cost, biggest first, so that a long prefill block does not start last and leave the other threads idle. Each
// item is computed by one thread in a fixed order: the thread count never changes a result.
//
// Threads: the calling thread and up to num_threads - 1 helpers on XLA's intra-op pool take items from one queue
// (work_queue.h: a busy pool costs parallelism, never a deadlock).
//
// Checked builds (-DCBJAX_CHECKED=1, library.py's "checked" option): the metadata of the live sequences that the
// default build clamps (page ids outside [0, P), kv_lens outside [0, W * G]) or skips (cu_q_lens not rising
// within [0, T]) is an InvalidArgument error naming the entry, raised before any item runs. The default build
// stays memory-safe on such input but attends over whatever page the clamp lands on: a silently wrong answer.

#include <memory>
#include <string>

#include "attention_common.h"
#include "work_queue.h"

namespace ffi = xla::ffi;

namespace cbjax_cpu {
namespace {

// Query rows per prefill item: about 128 query vectors (rows x the R heads of a kv head) share each K/V block
// converted to f32; fewer rows would convert K/V more often, more would leave too few items for the threads.
int32_t prefill_block_rows(int64_t R) { return static_cast<int32_t>(std::max<int64_t>(8, 128 / R)); }

// One call's work: shared by the calling thread and its helpers (work_queue.h).
struct Batch {
  Problem p;
  AttendFn decode, prefill;
  std::vector<Item> items;
  WorkQueue queue;  // item i: items[i / K], kv head i % K

  void drain() {
    Scratch scratch;
    for (int64_t i; (i = queue.claim()) >= 0;) {
      const Item& it = items[i / p.K];
      (it.rows == 1 ? decode : prefill)(p, it, i % p.K, scratch);
    }
  }
};

// The items of the live sequences, from the runtime metadata. Garbage is tolerated: rows outside [0, T), contexts
// past the page table (W * G), and queries at negative positions (q_len > kv_len) get no item and stay zero.
void make_items(const Problem& p, const int32_t* kv, const int32_t* cu, int64_t live, int32_t rows,
                std::vector<Item>& items) {
  const int64_t max_len = p.W * p.G;
  const int32_t block = prefill_block_rows(p.R);
  for (int64_t i = 0; i < live; ++i) {
    const int64_t a = cu[i], b = cu[i + 1], q_len = b - a;
    if (q_len < 1 || a < 0 || b > p.T) continue;
    if (!(rows & (q_len == 1 ? 1 : 2))) continue;
    const int64_t kv_len = std::min<int64_t>(std::max(kv[i], 0), max_len);
    for (int64_t r = std::max<int64_t>(a, a + q_len - kv_len); r < b; r += block) {  // rows at positions >= 0
      const int64_t end = kv_len - q_len + (r - a) + 1;  // row r sees positions < end
      const int64_t start = p.window > 0 ? std::max<int64_t>(end - p.window, 0) : 0;
      const int64_t n = std::min<int64_t>(block, b - r);
      items.push_back({static_cast<int32_t>(i), static_cast<int32_t>(r), static_cast<int32_t>(n),
                       static_cast<int32_t>(start), static_cast<int32_t>(end)});
    }
  }
  // Biggest first: a row block costs its rows times the context they see.
  auto cost = [](const Item& it) { return static_cast<int64_t>(it.rows) * (it.end - it.start + it.rows / 2); };
  std::stable_sort(items.begin(), items.end(), [&](const Item& x, const Item& y) { return cost(x) > cost(y); });
}

#if defined(CBJAX_CHECKED) && CBJAX_CHECKED
// The checked build's checks (see the top of this file): the live sequences' cu_q_lens and kv_lens, then every
// page-table entry an item will read (positions [start, end + rows - 1); entries before a sliding window's start
// and past the context are never read, so they may hold anything).
ffi::Error check_metadata(const Problem& p, const int32_t* kv, const int32_t* cu, int64_t live,
                          const std::vector<Item>& items) {
  auto at = [](const char* name, int64_t i, int64_t value) {
    return std::string(name) + "[" + std::to_string(i) + "] = " + std::to_string(value);
  };
  for (int64_t i = 0; i < live; ++i) {
    if (cu[i] < 0 || cu[i + 1] < cu[i] || cu[i + 1] > p.T)
      return ffi::Error::InvalidArgument(at("cu_q_lens", i + 1, cu[i + 1]) + " after " + at("cu_q_lens", i, cu[i]) +
                                         ": not rising within [0, T = " + std::to_string(p.T) + "]");
    if (kv[i] < 0 || kv[i] > p.W * p.G)
      return ffi::Error::InvalidArgument(at("kv_lens", i, kv[i]) + " is outside [0, W * G = " +
                                         std::to_string(p.W * p.G) + "]");
  }
  for (const Item& it : items) {
    const int64_t last = it.end + it.rows - 1;  // one past the last position the item reads
    for (int64_t j = it.start / p.G; j <= (last - 1) / p.G; ++j) {
      const int32_t page = p.page_indices[static_cast<int64_t>(it.seq) * p.W + j];
      if (page < 0 || page >= p.P)
        return ffi::Error::InvalidArgument("page_indices[" + std::to_string(it.seq) + ", " + std::to_string(j) +
                                           "] = " + std::to_string(page) + " is outside [0, P = " +
                                           std::to_string(p.P) + ")");
    }
  }
  return ffi::Error::Success();
}
#endif

// Aliases: a comma inside a template argument list would split the handler macro's arguments.
using I32Vector = ffi::Buffer<ffi::S32, 1>;
using I32Matrix = ffi::Buffer<ffi::S32, 2>;
using F32Buffer = ffi::Buffer<ffi::F32>;

ffi::Error RaggedAttention(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages,
                           I32Vector kv_lens, I32Matrix page_indices, I32Vector cu_q_lens, I32Vector num_seqs,
                           F32Buffer k_scales, F32Buffer v_scales, float sm_scale, float soft_cap,
                           int32_t sliding_window, int32_t num_threads, int32_t rows, int32_t bf16_dots,
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
  if (rows < 1 || rows > 3) return ffi::Error::InvalidArgument("rows must be 1 (decode), 2 (prefill) or 3 (both)");
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
    const int64_t scale_rows = p.K * p.P * p.G;
    if (k_scales.element_count() != scale_rows || v_scales.element_count() != scale_rows)
      return ffi::Error::InvalidArgument("int8 pages need k_scales and v_scales [K, P, G, 1]");
    p.k_scales = k_scales.typed_data();
    p.v_scales = v_scales.typed_data();
  }
  p.out = out->untyped_data();
  p.page_indices = page_indices.typed_data();

  std::memset(p.out, 0, out->size_bytes());
  if (p.T == 0 || p.P == 0 || p.G == 0 || p.W == 0) return ffi::Error::Success();

  auto batch = std::make_shared<Batch>();
  batch->p = p;
  batch->decode = pick_decode(dt, kv_dt, p.H);
  // bf16_dots: a permission (the caller accepts q and the softmax weights rounded to bf16), taken where it applies.
  if (bf16_dots) {
    if (AttendFn fast = pick_decode_bf16_dots(dt, kv_dt, p.H)) batch->decode = fast;
  }
  batch->prefill = pick_prefill(dt, kv_dt, p.H);
  const int64_t live = std::min<int64_t>(std::max<int32_t>(num_seqs.typed_data()[0], 0), p.S);
  make_items(p, kv_lens.typed_data(), cu_q_lens.typed_data(), live, rows, batch->items);
#if defined(CBJAX_CHECKED) && CBJAX_CHECKED
  ffi::Error bad = check_metadata(p, kv_lens.typed_data(), cu_q_lens.typed_data(), live, batch->items);
  if (bad.failure()) return bad;
#endif
  if (batch->items.empty()) return ffi::Error::Success();

  const int64_t total = static_cast<int64_t>(batch->items.size()) * p.K;
  batch->queue.set_total(total);
  int64_t helpers = num_threads > 0 ? num_threads - 1 : pool.num_threads();
  run_on_pool(pool, std::min(helpers, total - 1), batch);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace cbjax_cpu

XLA_FFI_DEFINE_HANDLER_SYMBOL(CbjaxCpuRaggedAttention, cbjax_cpu::RaggedAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()            // q [T, N, H]
                                  .Arg<ffi::AnyBuffer>()            // k_pages [K, P, G, H]
                                  .Arg<ffi::AnyBuffer>()            // v_pages [K, P, G, H]
                                  .Arg<cbjax_cpu::I32Vector>()      // kv_lens [S]
                                  .Arg<cbjax_cpu::I32Matrix>()      // page_indices [S, W]
                                  .Arg<cbjax_cpu::I32Vector>()      // cu_q_lens [S + 1]
                                  .Arg<cbjax_cpu::I32Vector>()      // num_seqs [1]
                                  .Arg<cbjax_cpu::F32Buffer>()      // k_scales [K, P, G, 1] (int8 pages)
                                  .Arg<cbjax_cpu::F32Buffer>()      // v_scales
                                  .Attr<float>("sm_scale")
                                  .Attr<float>("soft_cap")          // <= 0: none
                                  .Attr<int32_t>("sliding_window")  // <= 0: none
                                  .Attr<int32_t>("num_threads")     // <= 0: the intra-op pool's size
                                  .Attr<int32_t>("rows")            // 1 decode, 2 prefill, 3 both
                                  .Attr<int32_t>("bf16_dots")       // 1: decode over bf16 pages by vdpbf16ps
                                  .Ret<ffi::AnyBuffer>()            // out [T, N, H], q's dtype
);
