// Streams the tokens of each step of a block of decode steps to the host as that step ends (runner/token_stream.py,
// runner/decode_loop.py): one XLA FFI handler the device loop calls once per step, and one C function the host
// calls (through ctypes, which releases the GIL) to wait for a step's row and copy it out.
//
// Why: a block of N decode steps in one dispatch pays the host's schedule, pack and launch once per N steps, but
// its tokens reached the host only at the block's end, so a streaming client saw N tokens at once. A Python host
// callback per step (jax's io_callback) cost 0.3-1 ms of the device loop per step here (GIL, numpy, dispatch);
// this is a memcpy of one row and a futex wake.
//
// The ring is host memory the caller owns (a numpy int32 array, alive for the process): `cap` sequence words, then
// `cap` rows of `width` int32, then one stop word: the base position of a block the host asks to end early (a
// request arrived: the loop ends after the step that reads it, and the engine gives the other steps back). Step position p (a uint32 counter the host assigns, base + step) goes to slot
// p % cap; the slot's word is 0 while its row is written and p + 1 once it is complete (a seqlock: the reader
// copies the row and checks the word again). The host keeps at most cap / 2 positions in flight, so a row is
// never overwritten before it is read; a stale or overwritten row is reported, never returned.

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstdint>
#include <cstring>
#include <ctime>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace cbjax_cpu {
namespace {

// Aliases: a comma inside a template argument list would split the handler macro's arguments.
using Vector = ffi::Buffer<ffi::S32, 1>;
using Scalar = ffi::Buffer<ffi::S32, 0>;

inline uint32_t* ring_words(int64_t addr) { return reinterpret_cast<uint32_t*>(addr); }

inline int32_t* ring_row(int64_t addr, uint32_t cap, uint32_t width, uint32_t slot) {
  return reinterpret_cast<int32_t*>(addr) + cap + static_cast<int64_t>(slot) * width;
}

// meta [5] int32: the ring's address (low, high 32 bits; 0: streaming off, only the copy below), the block's
// base position, cap, width. step: this step's index in the block. tokens [width]: its sampled tokens, returned as
// they are: the loop uses the output, so the call is neither dropped nor marked as an effect (an effect would take
// the program off jax's fast C++ dispatch path: ~0.9 ms per call here instead of ~0.3). stop: 1 if the host asked
// this block to end after this step (the stop word holds its base), else 0.
ffi::Error StreamTokens(Vector meta, Scalar step, Vector tokens, ffi::Result<Vector> out, ffi::Result<Scalar> stop) {
  if (meta.dimensions()[0] != 5) return ffi::Error::InvalidArgument("token stream meta must be [5] int32");
  if (out->dimensions()[0] != tokens.dimensions()[0])
    return ffi::Error::InvalidArgument("token stream: the output must be the tokens' shape");
  std::memcpy(out->typed_data(), tokens.typed_data(), tokens.dimensions()[0] * sizeof(int32_t));
  stop->typed_data()[0] = 0;
  const int32_t* m = meta.typed_data();
  const int64_t addr = static_cast<int64_t>(static_cast<uint32_t>(m[0])) |
                       (static_cast<int64_t>(static_cast<uint32_t>(m[1])) << 32);
  if (addr == 0) return ffi::Error::Success();
  const uint32_t cap = static_cast<uint32_t>(m[3]), width = static_cast<uint32_t>(m[4]);
  if (cap == 0 || static_cast<int64_t>(width) != tokens.dimensions()[0])
    return ffi::Error::InvalidArgument("token stream: the ring's width must be the tokens' length");
  const uint32_t pos = static_cast<uint32_t>(m[2]) + static_cast<uint32_t>(step.typed_data()[0]);
  const uint32_t slot = pos % cap;
  uint32_t* word = ring_words(addr) + slot;
  __atomic_store_n(word, 0u, __ATOMIC_RELEASE);  // being written
  __atomic_thread_fence(__ATOMIC_RELEASE);
  std::memcpy(ring_row(addr, cap, width, slot), tokens.typed_data(), width * sizeof(int32_t));
  __atomic_store_n(word, pos + 1u, __ATOMIC_RELEASE);
  syscall(SYS_futex, word, FUTEX_WAKE_PRIVATE, INT_MAX, nullptr, nullptr, 0);
  const uint32_t* stop_word = ring_words(addr) + cap + static_cast<int64_t>(cap) * width;
  stop->typed_data()[0] = __atomic_load_n(stop_word, __ATOMIC_ACQUIRE) == static_cast<uint32_t>(m[2]) ? 1 : 0;
  return ffi::Error::Success();
}

}  // namespace
}  // namespace cbjax_cpu

XLA_FFI_DEFINE_HANDLER_SYMBOL(CbjaxCpuStreamTokens, cbjax_cpu::StreamTokens,
                              ffi::Ffi::Bind()
                                  .Arg<cbjax_cpu::Vector>()  // meta [5]
                                  .Arg<cbjax_cpu::Scalar>()  // the step's index in the block
                                  .Arg<cbjax_cpu::Vector>()  // the step's tokens [width]
                                  .Ret<cbjax_cpu::Vector>()  // the tokens, unchanged
                                  .Ret<cbjax_cpu::Scalar>()  // 1: end the block after this step
);

// The host's side: wait until position `pos` of the ring at `ring` is complete, copy its first `n` tokens to
// `dst`. Returns 1 (copied), 0 (not complete within `timeout_us`), -1 (the slot holds a later position, or was
// rewritten while being copied: the row is lost; the caller reads the block's tokens at its end instead).
extern "C" int CbjaxStreamTake(void* ring, uint32_t cap, uint32_t width, uint32_t pos, int32_t* dst, uint32_t n,
                               int64_t timeout_us) {
  if (cap == 0 || n > width) return -1;
  const int64_t addr = reinterpret_cast<int64_t>(ring);
  const uint32_t slot = pos % cap, want = pos + 1u;
  uint32_t* word = cbjax_cpu::ring_words(addr) + slot;
  timespec start;
  clock_gettime(CLOCK_MONOTONIC, &start);
  for (;;) {
    uint32_t seen = __atomic_load_n(word, __ATOMIC_ACQUIRE);
    if (seen == want) {
      std::memcpy(dst, cbjax_cpu::ring_row(addr, cap, width, slot), n * sizeof(int32_t));
      __atomic_thread_fence(__ATOMIC_ACQUIRE);
      return __atomic_load_n(word, __ATOMIC_ACQUIRE) == want ? 1 : -1;
    }
    // A later position in the slot (the difference read as signed: positions wrap around 2^32): overwritten.
    if (seen != 0 && static_cast<int32_t>(seen - want) > 0) return -1;
    timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    const int64_t waited_us = (now.tv_sec - start.tv_sec) * 1000000 + (now.tv_nsec - start.tv_nsec) / 1000;
    if (waited_us >= timeout_us) return 0;
    const int64_t left_us = timeout_us - waited_us;
    timespec wait = {static_cast<time_t>(left_us / 1000000), static_cast<long>((left_us % 1000000) * 1000)};
    syscall(SYS_futex, word, FUTEX_WAIT_PRIVATE, seen, &wait, nullptr, 0);  // until the word changes
  }
}
