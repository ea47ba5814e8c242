// SPDX-License-Identifier: Apache-2.0
#include "client/call_queue.h"

#include <utility>

namespace lossd {
namespace client {

CallQueue::CallQueue(int threads) : max_threads_(threads < 1 ? 1 : threads) {}

CallQueue::~CallQueue() {
  std::deque<Call> waiting;
  std::vector<std::thread> threads;
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    waiting.swap(queue_);
    threads.swap(threads_);
  }
  for (Call& c : waiting) {
    if (c.cancel) c.cancel();
  }
  for (std::thread& t : threads) t.join();
}

void CallQueue::Add(Call call) {
  {
    absl::MutexLock lock(&mu_);
    if (!stopping_) {
      queue_.push_back(std::move(call));
      // A thread more only where every one is busy: the calls beyond max_threads_ wait.
      if (idle_ < static_cast<int>(queue_.size()) &&
          static_cast<int>(threads_.size()) < max_threads_) {
        threads_.emplace_back([this] { Work(); });
      }
      return;
    }
  }
  if (call.cancel) call.cancel();
}

void CallQueue::Work() {
  for (;;) {
    Call call;
    {
      absl::MutexLock lock(&mu_);
      ++idle_;
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stopping_ || !queue_.empty();
      };
      mu_.Await(absl::Condition(&ready));
      --idle_;
      if (queue_.empty()) return;  // stopping
      call = std::move(queue_.front());
      queue_.pop_front();
    }
    call.run();
  }
}

}  // namespace client
}  // namespace lossd
