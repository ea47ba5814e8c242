// SPDX-License-Identifier: Apache-2.0
#include "engine/admission.h"

#include <utility>

namespace lossd {

absl::Status Admission::Request(uint64_t bytes, absl::string_view what,
                                MemoryBudget::Callback done) {
  uint64_t ticket = 0;
  // The callback may run before Reserve returns (memory free now) or later, on the thread
  // that releases memory; it records the grant before the caller hears of it, so a Release
  // from inside `done` already returns the bytes.
  absl::Status s = budget_->Reserve(
      bytes, what,
      [this, bytes, done = std::move(done)](absl::Status st) {
        {
          absl::MutexLock lock(&mu_);
          answered_ = true;
          if (st.ok()) granted_ = bytes;
        }
        done(std::move(st));
      },
      &ticket);
  if (!s.ok()) return s;
  bool withdraw = false;
  {
    absl::MutexLock lock(&mu_);
    ticket_ = ticket;
    withdraw = withdrawn_ && !answered_;
  }
  // Withdrawn after the caller decided to ask but before the ticket was known. Cancel is a
  // no-op once granted (the callback runs exactly once either way).
  if (withdraw) budget_->Cancel(ticket);
  return absl::OkStatus();
}

void Admission::Withdraw() {
  uint64_t ticket = 0;
  {
    absl::MutexLock lock(&mu_);
    withdrawn_ = true;
    if (answered_ || ticket_ == 0) return;  // nothing waits, or Request cancels it
    ticket = ticket_;
  }
  budget_->Cancel(ticket);  // its callback answers with CANCELLED
}

bool Admission::withdrawn() const {
  absl::MutexLock lock(&mu_);
  return withdrawn_;
}

void Admission::Release() {
  uint64_t bytes = 0;
  {
    absl::MutexLock lock(&mu_);
    bytes = granted_;
    granted_ = 0;
  }
  if (bytes > 0) budget_->Release(bytes);
}

uint64_t Admission::granted_bytes() const {
  absl::MutexLock lock(&mu_);
  return granted_;
}

}  // namespace lossd
