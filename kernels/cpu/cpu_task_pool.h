// SPDX-License-Identifier: Apache-2.0
// The CPU backend's worker threads: a fixed pool, started once, that runs the tasks [0, n) of
// one parallel step on the workers and the calling thread. It never decides what a task
// computes, so results never depend on which thread runs a task or how many threads there are.
#ifndef LOSSD_KERNELS_CPU_CPU_TASK_POOL_H_
#define LOSSD_KERNELS_CPU_CPU_TASK_POOL_H_

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace lossd {

// Tasks of `b` items that cover `a` items (a >= 0, b > 0).
inline int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// A fixed set of worker threads, started once: a server calls Compute often, and OpenBLAS
// keeps per-thread state, so short-lived threads would cost both time and memory.
class CpuTaskPool {
 public:
  // threads - 1 workers (fewer if a thread cannot be started: the same results, only later).
  explicit CpuTaskPool(int threads);
  ~CpuTaskPool();
  CpuTaskPool(const CpuTaskPool&) = delete;
  CpuTaskPool& operator=(const CpuTaskPool&) = delete;

  // Runs fn(task) for every task in [0, n) on the workers and the caller; returns when all
  // are done. What a task computes never depends on which thread runs it, so neither do the
  // results. One Run at a time: concurrent callers queue.
  void Run(int64_t n, const std::function<void(int64_t)>& fn);

 private:
  void Drain(const std::function<void(int64_t)>& fn, int64_t n);
  void WorkerLoop();

  std::mutex run_mu_;  // serialises Run
  std::mutex mu_;      // guards everything below but next_
  std::condition_variable wake_, done_;
  const std::function<void(int64_t)>* fn_ = nullptr;
  int64_t n_ = 0;
  std::atomic<int64_t> next_{0};
  int busy_ = 0;  // workers still in the current generation
  uint64_t generation_ = 0;
  bool stop_ = false;
  std::vector<std::thread> workers_;
};

}  // namespace lossd

#endif  // LOSSD_KERNELS_CPU_CPU_TASK_POOL_H_
