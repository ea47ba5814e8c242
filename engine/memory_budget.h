// SPDX-License-Identifier: Apache-2.0
// Admission by memory: a request runs only when its worst-case bytes fit in the budget.
// Requests that do not fit yet wait in FIFO order (no starvation: a large request at the head
// is not overtaken); one that could never fit is refused at once. Never blocks a caller.
#ifndef LOSSD_ENGINE_MEMORY_BUDGET_H_
#define LOSSD_ENGINE_MEMORY_BUDGET_H_

#include <cstdint>
#include <deque>
#include <functional>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"

namespace lossd {

class MemoryBudget {
 public:
  // Called exactly once: OK with the bytes reserved, or an error (cancelled, draining).
  using Callback = std::function<void(absl::Status)>;

  MemoryBudget(uint64_t budget_bytes, size_t max_waiters);

  // Reserves `bytes` now (runs `done(OK)` before returning) or queues the request. Returns
  // RESOURCE_EXHAUSTED when `bytes` exceeds the whole budget and UNAVAILABLE when the queue is
  // full or the budget is closed; `done` is then never called. On success returns a ticket
  // for Cancel() (never 0, so callers may use 0 for "none yet").
  absl::Status Reserve(uint64_t bytes, absl::string_view what, Callback done,
                       uint64_t* ticket);

  // Withdraws a queued request; its callback runs with CANCELLED. No-op once granted.
  void Cancel(uint64_t ticket);

  // Returns bytes to the budget and grants waiters in arrival order.
  void Release(uint64_t bytes);

  // Refuses new reservations and fails every waiter with UNAVAILABLE (graceful drain).
  void Close();

  uint64_t budget() const { return budget_; }
  uint64_t in_use() const;
  size_t waiting() const;

 private:
  struct Waiter {
    uint64_t ticket;
    uint64_t bytes;
    Callback done;
  };
  void GrantLocked(std::deque<Callback>* ready) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const uint64_t budget_;
  const size_t max_waiters_;
  mutable absl::Mutex mu_;
  uint64_t in_use_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t next_ticket_ ABSL_GUARDED_BY(mu_) = 1;
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  std::deque<Waiter> waiters_ ABSL_GUARDED_BY(mu_);
};

}  // namespace lossd

#endif  // LOSSD_ENGINE_MEMORY_BUDGET_H_
