// SPDX-License-Identifier: Apache-2.0
#include "service/put_weights_reactor.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "engine/message_bounds.h"
#include "service/tsan_annotations.h"
#include "service/wire_convert.h"

namespace lossd {

PutWeightsReactor::PutWeightsReactor(LossService* service, grpc::CallbackServerContext* ctx,
                                     v1::PutWeightsResponse* response)
    : service_(service),
      ctx_(ctx),
      response_(response),
      edge_(service, ctx, "PutWeights") {
  absl::Status s = edge_.Enter();
  if (!s.ok()) {
    FinishOnce(s);
    return;
  }
  // Armed until the weights are committed: a stripe done with its own range waits for its
  // siblings, which are the same client, and follows their activity (see OnHeader).
  edge_.idle()->Arm();
  StartRead(&request_);
}

bool PutWeightsReactor::LegalTransition(State from, State to) {
  if (to == State::kFinished) return from != State::kFinished;
  return (from == State::kHeader && to == State::kParts) ||
         (from == State::kParts && to == State::kWaitingForStripes);
}

void PutWeightsReactor::OnReadDone(bool ok) {
  if (ok) {
    edge_.idle()->Touch();
    if (upload_ && upload_->activity()) upload_->activity()->store(IdleWatch::Entry::Now());
  }
  absl::Status s = ok ? OnMessage() : OnEnd();
  if (!s.ok()) {
    if (upload_) upload_->Fail(s);  // a stripe takes its siblings down with it
    FinishOnce(s);
    return;
  }
  if (ok) StartRead(&request_);
}

void PutWeightsReactor::OnCancel() {
  // gRPC may run OnCancel from its own uninstrumented code; it returns before OnDone runs.
  LOSSD_TSAN_RELEASE_ON_EXIT(this);
  // Only a stripe waiting for its siblings has no operation pending to report the cancel.
  if (state_.get() == State::kWaitingForStripes) upload_->Fail(Cancelled());
}

void PutWeightsReactor::OnDone() {
  LOSSD_TSAN_ACQUIRE(this);  // every other reaction has returned (see OnCancel)
  edge_.Unwatch();
  LOSSD_TSAN_RELEASE(service_);  // the server's shutdown returns after every OnDone
  delete this;
}

absl::Status PutWeightsReactor::OnMessage() {
  return ReadUploadMessage(
      request_, "PutWeights", upload_ != nullptr,
      [this](const v1::WeightsHeader& h) { return OnHeader(h); },
      [this](const v1::TensorPart& part) { return OnPart(part); });
}

absl::Status PutWeightsReactor::OnHeader(const v1::WeightsHeader& h) {
  absl::Status size = CheckHeaderBytes(h.ByteSizeLong(), "the PutWeights header");
  if (!size.ok()) return size;
  UploadHeader header;
  auto w = TensorDescFromWire(h.has_w(), h.w(), "header.w");
  if (!w.ok()) return w.status();
  auto b = TensorDescFromWire(h.has_bias(), h.bias(), "header.bias");
  if (!b.ok()) return b.status();
  header.w = std::move(*w);
  header.bias = std::move(*b);
  header.upload_id = h.upload_id();
  header.stripes = h.stripes();
  header.w_begin = h.w_begin();
  header.w_end = h.w_end();
  auto u = WeightsUpload::Begin(service_->engine(), header, edge_.client(),
                                service_->Principal(ctx_));
  if (!u.ok()) return u.status();
  upload_ = std::move(*u);
  if (std::atomic<int64_t>* activity = upload_->activity()) {
    activity->store(IdleWatch::Entry::Now());
    edge_.idle()->Follow(activity);
  }
  state_.Set(State::kParts);
  return absl::OkStatus();
}

absl::Status PutWeightsReactor::OnPart(const v1::TensorPart& part) {
  if (part.tensor() != v1::TENSOR_W && part.tensor() != v1::TENSOR_BIAS) {
    return absl::InvalidArgumentError(absl::StrCat(
        "PutWeights accepts parts of TENSOR_W and TENSOR_BIAS, got ",
        v1::TensorId_IsValid(part.tensor()) ? v1::TensorId_Name(part.tensor())
                                            : absl::StrCat(static_cast<int>(part.tensor()))));
  }
  const uint64_t size = part.data().size();
  if (absl::Status s = edge_.CountPart(size); !s.ok()) return s;
  bytes_in_ += size;
  return upload_->Write(part.tensor() == v1::TENSOR_BIAS, part.offset(), part.data().data(),
                        size);
}

// Why a cancelled call ended: the client cancelled it, or the idle watch did.
absl::Status PutWeightsReactor::Cancelled() const {
  const bool stripe = upload_ && upload_->striped();
  if (edge_.idle()->expired()) {
    return absl::DeadlineExceededError(absl::StrCat(stripe ? "a stripe" : "PutWeights",
                                                    " was cancelled by the server: ",
                                                    edge_.idle()->Reason()));
  }
  return absl::CancelledError(stripe ? "a stripe was cancelled"
                                     : "the client cancelled PutWeights");
}

absl::Status PutWeightsReactor::OnEnd() {
  if (ctx_->IsCancelled()) return Cancelled();
  if (!upload_) {
    return absl::InvalidArgumentError("the PutWeights stream closed before its header");
  }
  service_->metrics()->AddBytesIn(static_cast<double>(bytes_in_));
  if (upload_->striped()) {
    absl::Status complete = upload_->CheckComplete();
    if (!complete.ok()) return complete;
    state_.Set(State::kWaitingForStripes);
    upload_->FinishStripe([this](absl::StatusOr<std::string> handle) {
      if (handle.ok()) {
        response_->set_handle(*handle);
        response_->set_bytes(upload_->bytes());
      }
      FinishOnce(handle.status());
    });
    return absl::OkStatus();
  }
  edge_.idle()->Disarm();
  auto handle = upload_->Commit();
  if (!handle.ok()) return handle.status();
  response_->set_handle(*handle);
  response_->set_bytes(upload_->bytes());
  FinishOnce(absl::OkStatus());
  return absl::OkStatus();
}

void PutWeightsReactor::FinishOnce(const absl::Status& s) {
  if (!state_.Finish()) return;
  // An upload cut off half way leaves no handle and frees its memory.
  if (upload_) upload_->Abandon();
  Finish(edge_.End(s, bytes_in_, 0));
}

}  // namespace lossd
