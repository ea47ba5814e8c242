// SPDX-License-Identifier: Apache-2.0
#include "engine/accumulator_contribution.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace lossd {

AccumulatorContribution::~AccumulatorContribution() { Delivered(false); }

void AccumulatorContribution::Added(std::shared_ptr<Accumulator> acc, uint64_t resets) {
  if (acc == nullptr) return;
  absl::MutexLock lock(&mu_);
  added_to_ = std::move(acc);
  resets_ = resets;
}

absl::Status AccumulatorContribution::Settle(absl::Status s, bool client_gone) {
  std::shared_ptr<Accumulator> acc;
  uint64_t resets = 0;
  {
    absl::MutexLock lock(&mu_);
    if (added_to_ == nullptr) return s;
    if (s.ok() && client_gone) {
      // Every result was written, but the client gave up before the status: it can only
      // see a failure, so this is one.
      s = absl::CancelledError("the call was cancelled before its OK status went out");
    }
    if (s.ok()) return s;  // held: Delivered says whether the OK reached the client
    acc = std::move(added_to_);
    resets = resets_;
  }
  // Added, but the client hears of a failure (a retry would add it twice): the sum is marked
  // partial rather than trusted, as after a failed update.
  return absl::Status(s.code(), absl::StrCat(s.message(), Engine::MarkPartial(*acc, resets)));
}

void AccumulatorContribution::Delivered(bool delivered) {
  std::shared_ptr<Accumulator> acc;
  uint64_t resets = 0;
  {
    absl::MutexLock lock(&mu_);
    acc = std::move(added_to_);
    resets = resets_;
  }
  if (acc == nullptr || delivered) return;
  // Finished OK, but the status never reached the client (it gave up at the last moment):
  // it sees a failure, so the added micro-batch is one.
  engine_->Submit([acc = std::move(acc), resets] { Engine::MarkPartial(*acc, resets); });
}

}  // namespace lossd
