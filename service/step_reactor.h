// SPDX-License-Identifier: Apache-2.0
// The Step call: a unary reactor that hands the rank's StepCall to the engine's HeadStore
// and finishes when the barrier's result comes back, possibly minutes later (the other ranks
// arrive, or --head_step_timeout passes), on whatever thread the engine calls back on. Never
// blocks a gRPC thread; the barrier, its arguments and its timeout are the engine's.
#ifndef LOSSD_SERVICE_STEP_REACTOR_H_
#define LOSSD_SERVICE_STEP_REACTOR_H_

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "engine/heads.h"
#include "grpcpp/grpcpp.h"
#include "lossd/v1/lossd.pb.h"
#include "service/loss_service.h"

namespace lossd {

// Lifetime: the engine's callback holds a shared Gate, never the reactor itself; whichever of
// the callback and OnCancel closes the gate first finishes the call, the other does nothing,
// so a result that arrives after the client cancelled (and the reactor is gone) is dropped.
class StepReactor final : public grpc::ServerUnaryReactor {
 public:
  StepReactor(LossService* service, grpc::CallbackServerContext* ctx,
              const v1::StepRequest* request, v1::StepResponse* response);

  void OnCancel() override;
  void OnDone() override;

 private:
  struct Gate {
    absl::Mutex mu;
    bool closed ABSL_GUARDED_BY(mu) = false;
    // True for the one caller that closes it.
    bool Close() {
      absl::MutexLock lock(&mu);
      if (closed) return false;
      closed = true;
      return true;
    }
  };

  absl::Status Start(const v1::StepRequest& request);
  void OnResult(absl::StatusOr<StepResult> result);
  void RecordStep(const absl::StatusOr<StepResult>& result);
  // Finishes the call with `s` (after Gate::Close returned true).
  void FinishNow(const absl::Status& s);

  LossService* const service_;
  grpc::CallbackServerContext* const ctx_;
  v1::StepResponse* const response_;
  const absl::Time started_;
  const std::string request_id_;  // sent back at once, named in the call's log lines
  const std::shared_ptr<Gate> gate_ = std::make_shared<Gate>();
  bool entered_ = true;
  StepCall call_;       // set in Start, before the engine may call back
};

}  // namespace lossd

#endif  // LOSSD_SERVICE_STEP_REACTOR_H_
