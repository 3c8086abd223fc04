// How the CPU kernels (attention_ffi.cc, gemm.cc) share a call's work items between the calling thread and
// helpers from XLA's intra-op pool.
//
// Items are taken from an atomic counter. The caller never waits for a helper that has not started: it drains the
// queue itself if need be, then waits only for helpers still inside an item, so a busy pool costs parallelism,
// never a deadlock. A helper that starts after the call returned sees `closed` and touches nothing else; for that
// the job (queue and everything its items read) is owned jointly by the call and its scheduled helpers.

#ifndef CBJAX_CPU_WORK_QUEUE_H_
#define CBJAX_CPU_WORK_QUEUE_H_

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>

#include "xla/ffi/api/ffi.h"

namespace cbjax_cpu {

class WorkQueue {
 public:
  void set_total(int64_t total) { total_ = total; }

  // The next item's index, or -1 once every item is taken.
  int64_t claim() {
    const int64_t i = next_.fetch_add(1, std::memory_order_relaxed);
    return i < total_ ? i : -1;
  }

  // On a helper: run `drain` unless the call has already returned.
  template <typename Drain>
  void help(Drain&& drain) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (closed_) return;
      ++running_;
    }
    drain();
    std::lock_guard<std::mutex> lock(mu_);
    if (--running_ == 0) cv_.notify_all();
  }

  // On the caller, once it found the queue empty: no helper starts an item after this; wait for those inside one.
  void close_and_wait() {
    std::unique_lock<std::mutex> lock(mu_);
    closed_ = true;
    cv_.wait(lock, [&] { return running_ == 0; });
  }

 private:
  int64_t total_ = 0;
  std::atomic<int64_t> next_{0};
  std::mutex mu_;
  std::condition_variable cv_;
  int running_ = 0;
  bool closed_ = false;
};

// Run job->drain() (which claims items from job->queue until it is empty) on the calling thread and on `helpers`
// threads of the pool; returns once every item is done.
template <typename Job>
void run_on_pool(xla::ffi::ThreadPool& pool, int64_t helpers, const std::shared_ptr<Job>& job) {
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([job] { job->queue.help([&] { job->drain(); }); });
  job->drain();
  job->queue.close_and_wait();
}

}  // namespace cbjax_cpu

#endif  // CBJAX_CPU_WORK_QUEUE_H_
