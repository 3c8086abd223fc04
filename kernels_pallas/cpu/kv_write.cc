// Writes a step's new K or V rows into the paged cache in place: one XLA FFI handler (library.py registers it,
// kernels_pallas/kv_write.py calls it with the pages aliased to the output).
//
// Why a handler for a scatter: XLA:CPU has no bfloat16 scatter. Its float normalization turns a scatter into bf16
// pages into "convert the whole cache to f32, scatter, convert it back", two passes over every page of the layer
// for a few rows (170 ms for a 128 MiB layer, measured), where the f32 scatter touches only the rows written.
//
// pages [K, P, G, X] (float32, bfloat16 or int8), rows [T, K, X] (float32 or bfloat16; int8 only into int8 pages),
// slot_mapping [T]: row t of kv head k goes to pages[k, s / G, s % G] with s = slot_mapping[t]. A slot outside
// [0, P * G) is skipped (the caller's contract never makes one; skipping keeps a bad one memory-safe). Rows are
// converted to the pages' dtype as XLA's convert does: bfloat16 by round to nearest even, NaN kept NaN.

#include <cstdint>
#include <cstring>

#include "attention_common.h"

namespace ffi = xla::ffi;

namespace cbjax_cpu {
namespace {

inline void convert(const float* src, Bf16* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    if (std::isnan(src[i])) {  // store() rounds; a NaN's payload could round into infinity
      uint32_t u;
      std::memcpy(&u, &src[i], sizeof u);
      dst[i].bits = static_cast<uint16_t>((u >> 16) | 0x0040u);
    } else {
      store(&dst[i], src[i]);
    }
  }
}
inline void convert(const Bf16* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = load(src[i]);
}
template <typename E>
inline void convert(const E* src, E* dst, int64_t n) {
  std::memcpy(dst, src, n * sizeof(E));
}

template <typename Src, typename Dst>
void write_rows(const Src* rows, Dst* pages, const int32_t* slots, int64_t T, int64_t K, int64_t rows_per_head,
                int64_t X) {
  for (int64_t t = 0; t < T; ++t) {
    const int64_t s = slots[t];
    if (s < 0 || s >= rows_per_head) continue;
    for (int64_t k = 0; k < K; ++k) convert(rows + (t * K + k) * X, pages + (k * rows_per_head + s) * X, X);
  }
}

// An alias: a comma inside a template argument list would split the handler macro's arguments.
using SlotVector = ffi::Buffer<ffi::S32, 1>;

ffi::Error WriteKvRows(ffi::AnyBuffer pages, ffi::AnyBuffer rows, SlotVector slot_mapping,
                       ffi::Result<ffi::AnyBuffer> out) {
  auto pd = pages.dimensions(), rd = rows.dimensions();
  if (pd.size() != 4 || rd.size() != 3)
    return ffi::Error::InvalidArgument("expected pages [K, P, G, X] and rows [T, K, X]");
  const int64_t K = pd[0], rows_per_head = pd[1] * pd[2], X = pd[3], T = rd[0];
  if (rd[1] != K || rd[2] != X || slot_mapping.dimensions()[0] != T)
    return ffi::Error::InvalidArgument("rows must be [T, K, X] for pages [K, P, G, X], slot_mapping [T]");
  const ffi::DataType pt = pages.element_type(), rt = rows.element_type();
  if (out->element_type() != pt || out->size_bytes() != pages.size_bytes())
    return ffi::Error::InvalidArgument("the output must be the pages (same dtype and shape)");
  // The caller aliases the pages to the output, so this copy never runs under XLA; it keeps a call without the
  // alias correct.
  if (out->untyped_data() != pages.untyped_data())
    std::memcpy(out->untyped_data(), pages.untyped_data(), pages.size_bytes());
  void* dst = out->untyped_data();
  const void* src = rows.untyped_data();
  const int32_t* slots = slot_mapping.typed_data();
  using DT = ffi::DataType;
  if (pt == DT::BF16 && rt == DT::F32)
    write_rows(static_cast<const float*>(src), static_cast<Bf16*>(dst), slots, T, K, rows_per_head, X);
  else if (pt == DT::BF16 && rt == DT::BF16)
    write_rows(static_cast<const Bf16*>(src), static_cast<Bf16*>(dst), slots, T, K, rows_per_head, X);
  else if (pt == DT::F32 && rt == DT::F32)
    write_rows(static_cast<const float*>(src), static_cast<float*>(dst), slots, T, K, rows_per_head, X);
  else if (pt == DT::F32 && rt == DT::BF16)
    write_rows(static_cast<const Bf16*>(src), static_cast<float*>(dst), slots, T, K, rows_per_head, X);
  else if (pt == DT::S8 && rt == DT::S8)
    write_rows(static_cast<const int8_t*>(src), static_cast<int8_t*>(dst), slots, T, K, rows_per_head, X);
  else
    return ffi::Error::InvalidArgument("pages float32, bfloat16 or int8; rows float32 or bfloat16 (int8 into int8)");
  return ffi::Error::Success();
}

}  // namespace
}  // namespace cbjax_cpu

XLA_FFI_DEFINE_HANDLER_SYMBOL(CbjaxCpuWriteKvRows, cbjax_cpu::WriteKvRows,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()               // pages [K, P, G, X]
                                  .Arg<ffi::AnyBuffer>()               // rows [T, K, X]
                                  .Arg<cbjax_cpu::SlotVector>()       // slot_mapping [T]
                                  .Ret<ffi::AnyBuffer>()               // the pages, aliased to the input
);
