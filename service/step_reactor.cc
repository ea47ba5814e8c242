// SPDX-License-Identifier: Apache-2.0
#include "service/step_reactor.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "core/status_macros.h"
#include "engine/message_bounds.h"
#include "service/head_wire.h"
#include "service/reactor_common.h"
#include "service/tsan_annotations.h"
#include "wire/unknown_fields.h"

namespace lossd {

StepReactor::StepReactor(LossService* service, grpc::CallbackServerContext* ctx,
                         const v1::StepRequest* request, v1::StepResponse* response)
    : service_(service),
      ctx_(ctx),
      response_(response),
      started_(absl::Now()),
      request_id_(BeginRequestId(ctx)) {
  // A rank waits at the barrier for the others: it takes no in-flight slot (EnterWaiting).
  absl::Status s = service_->EnterWaiting(ctx, "Step");
  if (!s.ok()) {
    entered_ = false;
    if (gate_->Close()) FinishNow(s);
    return;
  }
  s = Start(*request);
  if (!s.ok() && gate_->Close()) FinishNow(s);
}

absl::Status StepReactor::Start(const v1::StepRequest& request) {
  LOSSD_RETURN_IF_ERROR(RefuseUnknownFields(request, "StepRequest"));
  auto call = StepCallFromWire(request);
  if (!call.ok()) return call.status();
  LOSSD_RETURN_IF_ERROR(service_->engine()->heads().CheckInstance(
      request.head(), request.head_instance(), "StepRequest.head_instance",
      service_->Principal(ctx_)));
  call_ = std::move(*call);
  // The engine may answer inline (a refusal) or much later from its own threads; `gate`
  // decides who finishes, so the callback never touches a reactor OnCancel has finished.
  std::shared_ptr<Gate> gate = gate_;
  service_->engine()->heads().Step(
      call_, service_->Principal(ctx_),
      [this, gate](absl::StatusOr<StepResult> result) {
        if (!gate->Close()) return;  // cancelled: the call is over, the reactor may be gone
        OnResult(std::move(result));
      });
  return absl::OkStatus();
}

void StepReactor::OnResult(absl::StatusOr<StepResult> result) {
  RecordStep(result);
  if (result.ok()) *response_ = StepResponseToWire(*result, service_->options().instance);
  FinishNow(result.status());
}

// One step's metrics, counted once: by rank 0's call (every rank of a barrier gets the same
// result, and rank 0 is in every barrier), and not again for a retry the engine answers from
// the step already done.
void StepReactor::RecordStep(const absl::StatusOr<StepResult>& result) {
  if (call_.rank != 0 || (result.ok() && result->replayed)) return;
  ServerMetrics* m = service_->metrics();
  if (!result.ok()) {
    m->CountHeadStep("failed");
    return;
  }
  const StepResult& r = *result;
  m->ObserveHeadStep(r.step_seconds);
  if (call_.phase == StepPhase::kReduce) {
    m->CountHeadStep("reduced");
    m->SetHeadLastGradNorm(r.grad_norm);
    return;
  }
  m->CountHeadStep(r.applied ? "applied" : "skipped");
  m->AddHeadStepContributions(static_cast<double>(r.contributions),
                              static_cast<double>(r.tokens));
  m->SetHeadLastVersion(static_cast<double>(r.version));
  // An APPLY after a REDUCE carries the same norm; a skipped step's may be Inf or NaN.
  m->SetHeadLastGradNorm(r.grad_norm);
}

void StepReactor::OnCancel() {
  // gRPC may run OnCancel from its own uninstrumented code; it returns before OnDone runs.
  LOSSD_TSAN_RELEASE_ON_EXIT(this);
  if (!gate_->Close()) return;  // the result (or a refusal) is already going out
  FinishNow(absl::CancelledError(absl::StrCat(
      "the Step was cancelled (by the client, or its deadline passed) while rank ",
      call_.rank, " waited at the barrier of head '", ClippedText(call_.head), "' version ",
      call_.version)));
}

void StepReactor::OnDone() {
  LOSSD_TSAN_ACQUIRE(this);  // every other reaction has returned (see OnCancel)
  LOSSD_TSAN_RELEASE(service_);  // the server's shutdown returns after every OnDone
  delete this;
}

void StepReactor::FinishNow(const absl::Status& s) {
  grpc::Status g = RecordCall(service_, *ctx_, "Step", request_id_, started_, s, 0, 0);
  if (entered_) service_->LeaveWaiting();
  Finish(g);
}

}  // namespace lossd
