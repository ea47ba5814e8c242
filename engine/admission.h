// SPDX-License-Identifier: Apache-2.0
// One call's place in the memory budget (MemoryBudget): asks for the call's bytes once, may
// be withdrawn while it waits, and gives back what was granted when released or destroyed,
// so a granted reservation cannot outlive its call. Never blocks and never decides how many
// bytes a call needs (the plan or the fetch lease says so).
#ifndef LOSSD_ENGINE_ADMISSION_H_
#define LOSSD_ENGINE_ADMISSION_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "engine/memory_budget.h"

namespace lossd {

class Admission {
 public:
  explicit Admission(MemoryBudget* budget) : budget_(budget) {}
  ~Admission() { Release(); }
  Admission(const Admission&) = delete;
  Admission& operator=(const Admission&) = delete;

  // Asks for `bytes` (MemoryBudget::Reserve), at most once. `done` runs exactly once: OK once
  // the bytes are granted (possibly before Request returns, on this thread), else with the
  // reason (CANCELLED after Withdraw, UNAVAILABLE on drain). An error return means refused
  // at once; `done` then never runs. Call without holding a lock `done` takes.
  absl::Status Request(uint64_t bytes, absl::string_view what, MemoryBudget::Callback done);

  // Withdraws the request while it waits (its `done` runs with CANCELLED). Called before
  // Request has its ticket (or before Request at all), it takes effect as soon as it does.
  // No-op once granted. Any thread.
  void Withdraw();
  // Withdraw has been called.
  bool withdrawn() const;

  // Gives the granted bytes back to the budget now (waiters are granted); idempotent.
  void Release();
  uint64_t granted_bytes() const;

 private:
  MemoryBudget* const budget_;
  mutable absl::Mutex mu_;
  uint64_t ticket_ ABSL_GUARDED_BY(mu_) = 0;  // 0 until Reserve returns (no ticket is 0)
  bool withdrawn_ ABSL_GUARDED_BY(mu_) = false;
  bool answered_ ABSL_GUARDED_BY(mu_) = false;  // `done` has run (granted or refused)
  uint64_t granted_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace lossd

#endif  // LOSSD_ENGINE_ADMISSION_H_
