#include "service/create_head_reactor.h"

#include <cassert>
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

CreateHeadReactor::CreateHeadReactor(LossService* service, grpc::CallbackServerContext* ctx,
                                     v1::CreateHeadResponse* response)
    : service_(service),
      ctx_(ctx),
      response_(response),
      started_(absl::Now()),
      idle_(service->idle_watch().Watch([ctx] { ctx->TryCancel(); })) {
  absl::Status s = service_->Enter(ctx, "CreateHead", &client_);
  if (!s.ok()) {
    entered_ = false;
    FinishOnce(s);
    return;
  }
  idle_->Arm();  // waiting for the header and the parts
  StartRead(&request_);
}

bool CreateHeadReactor::LegalTransition(State from, State to) {
  if (to == State::kFinished) return from != State::kFinished;
  return from == State::kHeader && (to == State::kParts || to == State::kDropping);
}

void CreateHeadReactor::SetState(State next) {
  absl::MutexLock lock(&mu_);
  // A debug assert only: a wrong transition is this file's bug, never the client's.
  assert(LegalTransition(state_, next) && "illegal CreateHead state transition");
  if (LegalTransition(state_, next)) state_ = next;
}

CreateHeadReactor::State CreateHeadReactor::state() {
  absl::MutexLock lock(&mu_);
  return state_;
}

void CreateHeadReactor::OnReadDone(bool ok) {
  if (ok) idle_->Touch();
  absl::Status s = ok ? OnMessage() : OnEnd();
  if (!s.ok()) {
    FinishOnce(s);
    return;
  }
  if (ok) StartRead(&request_);
}

void CreateHeadReactor::OnDone() {
  service_->idle_watch().Unwatch(idle_);
  LOSSD_TSAN_RELEASE(service_);  // the server's shutdown returns after every OnDone
  delete this;
}

absl::Status CreateHeadReactor::OnMessage() {
  LOSSD_RETURN_IF_ERROR(RefuseUnknownFields(request_, "CreateHeadRequest"));
  const State now = state();
  if (request_.has_header()) {
    if (now != State::kHeader) {
      return absl::InvalidArgumentError("the CreateHead stream carries a second header");
    }
    return OnHeader(request_.header());
  }
  if (now == State::kHeader) {
    return absl::InvalidArgumentError(
        "the first message of a CreateHead stream must be a header");
  }
  return OnPart(request_.part());
}

absl::Status CreateHeadReactor::OnHeader(const v1::HeadHeader& h) {
  LOSSD_RETURN_IF_ERROR(CheckHeaderBytes(h.ByteSizeLong(), "the CreateHead header"));
  auto spec = HeadSpecFromWire(h, "header");
  if (!spec.ok()) return spec.status();
  auto created = service_->engine()->heads().BeginCreate(*spec, service_->Principal(ctx_));
  if (!created.ok()) return created.status();
  if (created->existing.has_value()) {
    existing_ = std::move(created->existing);
    SetState(State::kDropping);
    return absl::OkStatus();
  }
  pending_ = std::move(created->pending);
  SetState(State::kParts);
  return absl::OkStatus();
}

absl::Status CreateHeadReactor::OnPart(const v1::TensorPart& part) {
  const ServiceOptions& o = service_->options();
  const uint64_t size = part.data().size();
  if (++parts_ > o.max_parts_per_request) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the stream sent more than --max_parts_per_request=", o.max_parts_per_request,
        " parts; send larger parts"));
  }
  if (size > o.max_part_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a part carries ", size, " bytes, more than --max_part_bytes=", o.max_part_bytes));
  }
  auto tensor = HeadTensorFromWire(part.tensor(), "part.tensor");
  if (!tensor.ok()) return tensor.status();
  bytes_in_ += size;
  // The same head at the same version is already here: its parts change nothing.
  if (pending_ == nullptr) return absl::OkStatus();
  return service_->engine()->heads().WriteCreate(*pending_, *tensor, part.offset(),
                                                 part.data().data(), size);
}

// Why a cancelled call ended: the client cancelled it, or the idle watch did.
absl::Status CreateHeadReactor::Cancelled() const {
  if (idle_->expired()) {
    return absl::DeadlineExceededError(
        absl::StrCat("CreateHead was cancelled by the server: ", idle_->Reason()));
  }
  return absl::CancelledError("the client cancelled CreateHead; no head was made");
}

absl::Status CreateHeadReactor::OnEnd() {
  idle_->Disarm();
  if (ctx_->IsCancelled()) return Cancelled();
  const State now = state();
  if (now == State::kHeader) {
    return absl::InvalidArgumentError("the CreateHead stream closed before its header");
  }
  service_->metrics()->AddBytesIn(static_cast<double>(bytes_in_));
  const std::string& instance = service_->options().instance;
  if (now == State::kDropping) {
    *response_->mutable_head() = HeadInfoToWire(*existing_, instance);
    response_->set_created(false);
    FinishOnce(absl::OkStatus());
    return absl::OkStatus();
  }
  auto summary = service_->engine()->heads().CommitCreate(std::move(pending_));
  if (!summary.ok()) return summary.status();
  *response_->mutable_head() = HeadInfoToWire(*summary, instance);
  response_->set_created(true);
  FinishOnce(absl::OkStatus());
  return absl::OkStatus();
}

void CreateHeadReactor::FinishOnce(const absl::Status& s) {
  {
    absl::MutexLock lock(&mu_);
    if (state_ == State::kFinished) return;
    state_ = State::kFinished;  // legal from every other state
  }
  // A head cut off half way is never named, and its memory goes back now.
  pending_.reset();
  grpc::Status g = RecordCall(service_, *ctx_, "CreateHead", started_, s, bytes_in_, 0);
  if (entered_) service_->Leave(client_);
  Finish(g);
}

}  // namespace lossd
