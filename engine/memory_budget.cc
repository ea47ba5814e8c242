// SPDX-License-Identifier: Apache-2.0
#include "engine/memory_budget.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace lossd {

MemoryBudget::MemoryBudget(uint64_t budget_bytes, size_t max_waiters)
    : budget_(budget_bytes), max_waiters_(max_waiters) {}

absl::Status MemoryBudget::Reserve(uint64_t bytes, absl::string_view what, Callback done,
                                   uint64_t* ticket) {
  if (bytes > budget_) {
    return absl::ResourceExhaustedError(absl::StrCat(
        what, " needs ", bytes, " bytes at worst, more than the whole memory budget of ",
        budget_, " bytes (--memory_budget_bytes); split the batch or raise the budget"));
  }
  {
    absl::MutexLock lock(&mu_);
    if (closed_) return absl::UnavailableError("server is draining; retry on another replica");
    *ticket = next_ticket_++;
    // FIFO: only run at once when nobody is waiting, so a big request is never starved.
    if (!waiters_.empty() || in_use_ + bytes > budget_) {
      if (waiters_.size() >= max_waiters_) {
        return absl::UnavailableError(absl::StrCat(
            "admission queue is full (", waiters_.size(), " requests waiting, --max_queue=",
            max_waiters_, "); retry later"));
      }
      waiters_.push_back(Waiter{*ticket, bytes, std::move(done)});
      return absl::OkStatus();
    }
    in_use_ += bytes;
  }
  done(absl::OkStatus());
  return absl::OkStatus();
}

void MemoryBudget::Cancel(uint64_t ticket) {
  Callback cancelled;
  std::deque<Callback> ready;
  {
    absl::MutexLock lock(&mu_);
    for (auto it = waiters_.begin(); it != waiters_.end(); ++it) {
      if (it->ticket == ticket) {
        cancelled = std::move(it->done);
        waiters_.erase(it);
        break;
      }
    }
    GrantLocked(&ready);  // the head may have changed
  }
  if (cancelled) cancelled(absl::CancelledError("request cancelled while waiting for memory"));
  for (auto& cb : ready) cb(absl::OkStatus());
}

void MemoryBudget::Release(uint64_t bytes) {
  std::deque<Callback> ready;
  {
    absl::MutexLock lock(&mu_);
    in_use_ = bytes > in_use_ ? 0 : in_use_ - bytes;
    GrantLocked(&ready);
  }
  for (auto& cb : ready) cb(absl::OkStatus());
}

void MemoryBudget::GrantLocked(std::deque<Callback>* ready) {
  while (!waiters_.empty() && in_use_ + waiters_.front().bytes <= budget_) {
    in_use_ += waiters_.front().bytes;
    ready->push_back(std::move(waiters_.front().done));
    waiters_.pop_front();
  }
}

void MemoryBudget::Close() {
  std::deque<Waiter> failed;
  {
    absl::MutexLock lock(&mu_);
    closed_ = true;
    failed.swap(waiters_);
  }
  for (auto& w : failed) w.done(absl::UnavailableError("server is draining; retry on another replica"));
}

uint64_t MemoryBudget::in_use() const {
  absl::MutexLock lock(&mu_);
  return in_use_;
}

size_t MemoryBudget::waiting() const {
  absl::MutexLock lock(&mu_);
  return waiters_.size();
}

}  // namespace lossd
