// SPDX-License-Identifier: Apache-2.0
#include "engine/streamed_rows.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"

namespace lossd {

StreamedRows::StreamedRows(int64_t bt, absl::Duration stall, absl::Time deadline,
                           std::function<void(int64_t)> on_dx)
    : bt_(bt), stall_(stall), deadline_(deadline), on_dx_(std::move(on_dx)) {
  absl::MutexLock lock(&mu_);
  last_progress_ = absl::Now();
}

void StreamedRows::Arrived(int64_t rows) {
  absl::MutexLock lock(&mu_);
  if (rows <= arrived_) return;
  arrived_ = std::min(rows, bt_);
  last_progress_ = absl::Now();
  cv_.SignalAll();
}

void StreamedRows::Fail(const absl::Status& why) {
  absl::MutexLock lock(&mu_);
  if (!failed_.ok() || why.ok()) return;
  failed_ = why;
  cv_.SignalAll();
}

absl::Status StreamedRows::WaitX(int64_t rows) {
  rows = std::min(rows, bt_);
  absl::MutexLock lock(&mu_);
  while (true) {
    // Rows already in are used even when the stream failed later: the failure reaches the
    // compute at the first row it does not have (the caller fails the call either way).
    if (arrived_ >= rows) return absl::OkStatus();
    if (!failed_.ok()) return failed_;
    const absl::Time now = absl::Now();
    if (now >= deadline_) {
      return absl::DeadlineExceededError(absl::StrCat(
          "the deadline passed while the compute waited for rows [", arrived_, ", ", rows,
          ") of x (", arrived_, " of ", bt_, " rows received)"));
    }
    if (now >= last_progress_ + stall_) {
      return absl::DeadlineExceededError(absl::StrCat(
          "x stalled: no rows arrived for ", absl::FormatDuration(stall_), " while the compute ",
          "waited for rows [", arrived_, ", ", rows, ") (", arrived_, " of ", bt_,
          " rows received)"));
    }
    cv_.WaitWithDeadline(&mu_, std::min(deadline_, last_progress_ + stall_));
  }
}

void StreamedRows::DxReady(int64_t rows) {
  rows = std::min(rows, bt_);
  {
    absl::MutexLock lock(&mu_);
    if (rows <= dx_ready_) return;
    dx_ready_ = rows;
  }
  if (on_dx_) on_dx_(rows);
}

int64_t StreamedRows::arrived() const {
  absl::MutexLock lock(&mu_);
  return arrived_;
}

int64_t StreamedRows::dx_ready() const {
  absl::MutexLock lock(&mu_);
  return dx_ready_;
}

}  // namespace lossd
