// SPDX-License-Identifier: Apache-2.0
// A fixed pool of threads that runs compute jobs in submission order. Reactors hand their GPU
// or CPU work here so that no gRPC thread ever blocks on compute.
#ifndef LOSSD_ENGINE_EXECUTOR_H_
#define LOSSD_ENGINE_EXECUTOR_H_

#include <deque>
#include <functional>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"

namespace lossd {

class Executor {
 public:
  explicit Executor(int threads);
  ~Executor();  // runs every queued job, then joins

  void Submit(std::function<void()> job);
  size_t queued() const;
  // No job queued and every thread free: a job submitted now starts at once.
  bool idle() const;

 private:
  void Loop();

  mutable absl::Mutex mu_;
  std::deque<std::function<void()>> jobs_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  size_t running_ ABSL_GUARDED_BY(mu_) = 0;  // jobs being run now
  std::vector<std::thread> threads_;
};

}  // namespace lossd

#endif  // LOSSD_ENGINE_EXECUTOR_H_
