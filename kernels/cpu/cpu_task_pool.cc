// SPDX-License-Identifier: Apache-2.0
#include "kernels/cpu/cpu_task_pool.h"

#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>

namespace lossd {

CpuTaskPool::CpuTaskPool(int threads) {
  for (int k = 1; k < threads; ++k) {
    try {
      workers_.emplace_back([this] { WorkerLoop(); });
    } catch (...) {
      break;  // fewer threads give the same results, only later
    }
  }
}

CpuTaskPool::~CpuTaskPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  wake_.notify_all();
  for (std::thread& t : workers_) t.join();
}

void CpuTaskPool::Run(int64_t n, const std::function<void(int64_t)>& fn) {
  if (n <= 0) return;
  std::lock_guard<std::mutex> run_lock(run_mu_);
  if (n == 1 || workers_.empty()) {
    for (int64_t t = 0; t < n; ++t) fn(t);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    fn_ = &fn;
    n_ = n;
    next_.store(0);
    busy_ = static_cast<int>(workers_.size());
    ++generation_;
  }
  wake_.notify_all();
  Drain(fn, n);
  std::unique_lock<std::mutex> lock(mu_);
  done_.wait(lock, [this] { return busy_ == 0; });
  fn_ = nullptr;
}

void CpuTaskPool::Drain(const std::function<void(int64_t)>& fn, int64_t n) {
  for (int64_t t = next_.fetch_add(1); t < n; t = next_.fetch_add(1)) fn(t);
}

void CpuTaskPool::WorkerLoop() {
  uint64_t seen = 0;
  for (;;) {
    const std::function<void(int64_t)>* fn;
    int64_t n;
    {
      std::unique_lock<std::mutex> lock(mu_);
      wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      fn = fn_;
      n = n_;
    }
    Drain(*fn, n);
    std::lock_guard<std::mutex> lock(mu_);
    if (--busy_ == 0) done_.notify_one();
  }
}

}  // namespace lossd
