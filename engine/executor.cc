// SPDX-License-Identifier: Apache-2.0
#include "engine/executor.h"

#include <utility>

namespace lossd {

Executor::Executor(int threads) {
  if (threads < 1) threads = 1;
  for (int i = 0; i < threads; ++i) threads_.emplace_back([this] { Loop(); });
}

Executor::~Executor() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  for (auto& t : threads_) t.join();
}

void Executor::Submit(std::function<void()> job) {
  absl::MutexLock lock(&mu_);
  jobs_.push_back(std::move(job));
}

size_t Executor::queued() const {
  absl::MutexLock lock(&mu_);
  return jobs_.size();
}

bool Executor::idle() const {
  absl::MutexLock lock(&mu_);
  return jobs_.empty() && running_ < threads_.size();
}

void Executor::Loop() {
  for (;;) {
    std::function<void()> job;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](Executor* e) ABSL_NO_THREAD_SAFETY_ANALYSIS {
            return e->stopping_ || !e->jobs_.empty();
          },
          this));
      if (jobs_.empty()) return;  // stopping and drained
      job = std::move(jobs_.front());
      jobs_.pop_front();
      ++running_;
    }
    job();
    job = nullptr;  // what the job holds goes before the thread counts as free
    absl::MutexLock lock(&mu_);
    --running_;
  }
}

}  // namespace lossd
