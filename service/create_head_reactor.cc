// SPDX-License-Identifier: Apache-2.0
#include "service/create_head_reactor.h"

#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"
#include "engine/message_bounds.h"
#include "service/head_wire.h"
#include "service/tsan_annotations.h"

namespace lossd {

CreateHeadReactor::CreateHeadReactor(LossService* service, grpc::CallbackServerContext* ctx,
                                     v1::CreateHeadResponse* response)
    : service_(service),
      ctx_(ctx),
      response_(response),
      edge_(service, ctx, "CreateHead") {
  absl::Status s = edge_.Enter();
  if (!s.ok()) {
    FinishOnce(s);
    return;
  }
  edge_.idle()->Arm();  // waiting for the header and the parts
  StartRead(&request_);
}

bool CreateHeadReactor::LegalTransition(State from, State to) {
  if (to == State::kFinished) return from != State::kFinished;
  return from == State::kHeader && (to == State::kParts || to == State::kDropping);
}

void CreateHeadReactor::OnReadDone(bool ok) {
  if (ok) edge_.idle()->Touch();
  absl::Status s = ok ? OnMessage() : OnEnd();
  if (!s.ok()) {
    FinishOnce(s);
    return;
  }
  if (ok) StartRead(&request_);
}

void CreateHeadReactor::OnDone() {
  edge_.Unwatch();
  LOSSD_TSAN_RELEASE(service_);  // the server's shutdown returns after every OnDone
  delete this;
}

absl::Status CreateHeadReactor::OnMessage() {
  return ReadUploadMessage(
      request_, "CreateHead", state_.get() != State::kHeader,
      [this](const v1::HeadHeader& h) { return OnHeader(h); },
      [this](const v1::TensorPart& part) { return OnPart(part); });
}

absl::Status CreateHeadReactor::OnHeader(const v1::HeadHeader& h) {
  LOSSD_RETURN_IF_ERROR(CheckHeaderBytes(h.ByteSizeLong(), "the CreateHead header"));
  auto spec = HeadSpecFromWire(h, "header");
  if (!spec.ok()) return spec.status();
  auto created = service_->engine()->heads().BeginCreate(*spec, service_->Principal(ctx_));
  if (!created.ok()) return created.status();
  if (created->existing.has_value()) {
    existing_ = std::move(created->existing);
    state_.Set(State::kDropping);
    return absl::OkStatus();
  }
  pending_ = std::move(created->pending);
  state_.Set(State::kParts);
  return absl::OkStatus();
}

absl::Status CreateHeadReactor::OnPart(const v1::TensorPart& part) {
  const uint64_t size = part.data().size();
  LOSSD_RETURN_IF_ERROR(edge_.CountPart(size));
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
  if (edge_.idle()->expired()) {
    return absl::DeadlineExceededError(
        absl::StrCat("CreateHead was cancelled by the server: ", edge_.idle()->Reason()));
  }
  return absl::CancelledError("the client cancelled CreateHead; no head was made");
}

absl::Status CreateHeadReactor::OnEnd() {
  edge_.idle()->Disarm();
  if (ctx_->IsCancelled()) return Cancelled();
  const State now = state_.get();
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
  if (pending_->spec.group.size() > 1) {
    // Forming a group blocks until every member has joined (up to --head_group_timeout):
    // never on a gRPC thread. No read or callback of this reactor touches pending_ any more,
    // and the server's shutdown waits for the Finish this thread gives.
    std::thread([this] { Commit(); }).detach();
    return absl::OkStatus();
  }
  Commit();
  return absl::OkStatus();
}

void CreateHeadReactor::Commit() {
  auto summary = service_->engine()->heads().CommitCreate(std::move(pending_));
  if (!summary.ok()) {
    FinishOnce(summary.status());
    return;
  }
  *response_->mutable_head() = HeadInfoToWire(*summary, service_->options().instance);
  response_->set_created(true);
  FinishOnce(absl::OkStatus());
}

void CreateHeadReactor::FinishOnce(const absl::Status& s) {
  if (!state_.Finish()) return;
  // A head cut off half way is never named, and its memory goes back now.
  pending_.reset();
  Finish(edge_.End(s, bytes_in_, 0));
}

}  // namespace lossd
