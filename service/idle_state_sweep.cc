// SPDX-License-Identifier: Apache-2.0
#include "service/idle_state_sweep.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"

namespace lossd {

IdleStateSweep::IdleStateSweep(Engine* engine, absl::Duration ttl, Log log,
                               absl::Duration period)
    : engine_(engine), ttl_(ttl), log_(std::move(log)) {
  if (period <= absl::ZeroDuration()) {
    period = std::clamp(ttl / 4, absl::Milliseconds(10), absl::Seconds(30));
  }
  thread_ = std::thread([this, period] {
    absl::MutexLock lock(&mu_);
    while (!mu_.AwaitWithTimeout(absl::Condition(&stop_), period)) {
      mu_.Unlock();  // a sweep takes the stores' locks; Stop must not wait behind it
      SweepOnce();
      mu_.Lock();
    }
  });
}

IdleStateSweep::~IdleStateSweep() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  thread_.join();
}

size_t IdleStateSweep::SweepOnce() {
  const std::vector<std::string> dropped = engine_->DropIdleState(ttl_);
  for (const std::string& what : dropped) {
    log_(absl::StrCat("dropped ", what, ": unused for longer than --state_idle_ttl=",
                      absl::FormatDuration(ttl_)));
  }
  return dropped.size();
}

}  // namespace lossd
