// SPDX-License-Identifier: Apache-2.0
// The rows of one overlapped Compute (ComputeHeader.overlap): the receiver reports how many
// rows of X are in and checked, the backend waits for the rows it needs, and the sender hears
// of dX rows as they become final. Holds no tensor memory and knows nothing of gRPC.
#ifndef LOSSD_ENGINE_STREAMED_ROWS_H_
#define LOSSD_ENGINE_STREAMED_ROWS_H_

#include <cstdint>
#include <functional>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "core/loss_problem.h"

namespace lossd {

class StreamedRows final : public RowStream {
 public:
  // `stall`: the longest WaitX waits without any new row arriving before it gives up (the
  // compute holds the device meanwhile, so a sender that stops must not hold it for long).
  // `deadline`: the request's; WaitX gives up there too. `on_dx`: called by DxReady, on the
  // backend's thread (null = nobody listens).
  StreamedRows(int64_t bt, absl::Duration stall, absl::Time deadline,
               std::function<void(int64_t rows)> on_dx);

  // Receiver side: rows [0, rows) of X are in place (never decreases), or none will follow.
  void Arrived(int64_t rows);
  void Fail(const absl::Status& why);

  // Backend side (RowStream).
  absl::Status WaitX(int64_t rows) override;
  void DxReady(int64_t rows) override;

  int64_t arrived() const;
  int64_t dx_ready() const;

 private:
  const int64_t bt_;
  const absl::Duration stall_;
  const absl::Time deadline_;
  const std::function<void(int64_t)> on_dx_;
  mutable absl::Mutex mu_;
  absl::CondVar cv_;
  int64_t arrived_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t dx_ready_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Status failed_ ABSL_GUARDED_BY(mu_);
  absl::Time last_progress_ ABSL_GUARDED_BY(mu_);
};

}  // namespace lossd

#endif  // LOSSD_ENGINE_STREAMED_ROWS_H_
