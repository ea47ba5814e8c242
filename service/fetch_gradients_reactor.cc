// SPDX-License-Identifier: Apache-2.0
#include "service/fetch_gradients_reactor.h"

#include <algorithm>
#include <utility>

#include "lossd/v1/lossd.pb.h"
#include "service/reactor_common.h"
#include "service/tsan_annotations.h"
#include "service/wire_convert.h"
#include "wire/part_codec.h"

namespace lossd {

FetchGradientsReactor::FetchGradientsReactor(LossService* service,
                                             grpc::CallbackServerContext* ctx,
                                             const grpc::ByteBuffer* raw_request)
    : service_(service), ctx_(ctx), edge_(service, ctx, "FetchGradients") {
  absl::Status s = edge_.Enter();
  if (s.ok()) s = Start(*raw_request);
  if (!s.ok()) FinishOnce(s);
}

bool FetchGradientsReactor::LegalTransition(State from, State to) {
  if (to == State::kFinished) return from != State::kFinished;
  return (from == State::kChecking && to == State::kAdmitting) ||
         (from == State::kAdmitting && to == State::kQueued) ||
         (from == State::kQueued && to == State::kSending);
}

// Reads the request and asks the lease for memory; the lease's callback goes on.
absl::Status FetchGradientsReactor::Start(const grpc::ByteBuffer& raw_request) {
  v1::FetchGradientsRequest request;
  auto part_bytes =
      ReadStreamedRequest(raw_request, "FetchGradients", service_->options(), &request);
  if (!part_bytes.ok()) return part_bytes.status();
  part_bytes_ = *part_bytes;
  FetchRequest r;
  r.accumulator = request.accumulator();
  r.accumulator_instance = request.accumulator_instance();
  r.principal = service_->Principal(ctx_);
  r.reset = request.reset();
  r.begin = request.range_begin();
  r.end = request.range_end();
  auto lease = FetchLease::Check(service_->engine(), std::move(r));
  if (!lease.ok()) return lease.status();
  lease_ = std::move(*lease);
  state_.Set(State::kAdmitting);
  return lease_->Admit([this](absl::Status st) { OnAdmitted(std::move(st)); });
}

void FetchGradientsReactor::OnCancel() {
  // gRPC may run OnCancel from its own uninstrumented code; it returns before OnDone runs.
  LOSSD_TSAN_RELEASE_ON_EXIT(this);
  // Still waiting for memory: withdrawn, its callback fails the call with CANCELLED. Once
  // granted, the snapshot or its writes finish the call.
  if (lease_) lease_->Withdraw();
}

void FetchGradientsReactor::OnWriteDone(bool ok) {
  edge_.idle()->WriteDone();
  if (!ok) {
    FinishOnce(edge_.WriteFailed("the client went away while gradients were being sent"));
    return;
  }
  SendNext();
}

void FetchGradientsReactor::OnDone() {
  LOSSD_TSAN_ACQUIRE(this);  // every other reaction has returned (see OnCancel)
  edge_.Unwatch();
  // Finished OK, but did the status reach the client (it may give up at the last moment)?
  if (lease_) lease_->Delivered(!ctx_->IsCancelled());
  LOSSD_TSAN_RELEASE(service_);  // the server's shutdown returns after every OnDone
  delete this;
}

// Runs once, from Admit or from whichever thread released the memory it waited for.
void FetchGradientsReactor::OnAdmitted(absl::Status s) {
  if (!s.ok()) {
    FinishOnce(s);
    return;
  }
  state_.Set(State::kQueued);
  service_->engine()->Submit([this] { TakeSnapshot(); });
}

void FetchGradientsReactor::TakeSnapshot() {
  if (ctx_->IsCancelled()) {
    // Gone while it waited for memory or the executor: nothing is read, nothing reset.
    FinishOnce(absl::CancelledError(
        "the call was cancelled before its snapshot was taken; nothing was read or reset"));
    return;
  }
  if (absl::Status s = lease_->TakeSnapshot(); !s.ok()) {
    FinishOnce(s);
    return;
  }
  const GradientsSnapshot& g = lease_->snapshot();
  v1::FetchGradientsResponse response;
  v1::GradientsHeader* h = response.mutable_header();
  *h->mutable_dw() = TensorSpecToWire(DType::kF32, {g.v, g.h});
  if (g.has_bias) *h->mutable_db() = TensorSpecToWire(DType::kF32, {g.v});
  h->set_micro_batches(g.micro_batches);
  h->set_tokens(g.tokens);
  h->set_instance(service_->options().instance);
  offset_ = g.begin;
  state_.Set(State::kSending);
  response_ = wire::EncodeMessage(response);
  Write();
}

// Sends the snapshot's bytes as parts of DW and DB (a part never straddles the two).
void FetchGradientsReactor::SendNext() {
  const GradientsSnapshot& g = lease_->snapshot();
  const uint64_t dw_bytes = g.dw_bytes();
  if (offset_ >= g.end) {
    service_->metrics()->AddBytesOut(static_cast<double>(g.end - g.begin));
    FinishOnce(absl::OkStatus());
    return;
  }
  const bool in_db = offset_ >= dw_bytes;
  const uint64_t tensor_end = in_db ? g.end : std::min(g.end, dw_bytes);
  const uint64_t n = std::min<uint64_t>(part_bytes_, tensor_end - offset_);
  const SharedOutputs& data = lease_->data();
  response_ = wire::EncodePartSlice(
      in_db ? v1::TENSOR_DB : v1::TENSOR_DW, in_db ? offset_ - dw_bytes : offset_,
      OutputSlice(data, (*data)[0].get() + (offset_ - g.begin), n));
  offset_ += n;
  Write();
}

// Every response message goes out here: the client has --stream_idle_timeout to take it.
void FetchGradientsReactor::Write() {
  edge_.idle()->WriteStarted();
  StartWrite(&response_);
}

void FetchGradientsReactor::FinishOnce(absl::Status s) {
  if (!state_.Finish()) return;
  if (lease_ == nullptr) {
    FinishNow(s);
    return;
  }
  // The lease decides what the client may be told (a reset it never heard of is undone, on
  // the executor) and gives the memory back before the call finishes.
  lease_->Settle(std::move(s), ctx_->IsCancelled(),
                 [this](absl::Status st) { FinishNow(st); });
}

void FetchGradientsReactor::FinishNow(const absl::Status& s) {
  const uint64_t begin = lease_ != nullptr ? lease_->snapshot().begin : 0;
  Finish(edge_.End(s, 0, offset_ > begin ? offset_ - begin : 0));
}

}  // namespace lossd
