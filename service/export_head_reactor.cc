// SPDX-License-Identifier: Apache-2.0
#include "service/export_head_reactor.h"

#include <algorithm>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"
#include "engine/message_bounds.h"
#include "lossd/v1/lossd.pb.h"
#include "service/head_wire.h"
#include "service/tsan_annotations.h"
#include "wire/part_codec.h"

namespace lossd {

ExportHeadReactor::ExportHeadReactor(LossService* service, grpc::CallbackServerContext* ctx,
                                     const grpc::ByteBuffer* raw_request)
    : service_(service),
      ctx_(ctx),
      edge_(service, ctx, "ExportHead"),
      admission_(&service->engine()->budget()) {
  absl::Status s = edge_.Enter();
  if (s.ok()) s = Start(*raw_request);
  if (!s.ok()) FinishOnce(s);
}

bool ExportHeadReactor::LegalTransition(State from, State to) {
  if (to == State::kFinished) return from != State::kFinished;
  return (from == State::kChecking && to == State::kAdmitting) ||
         (from == State::kAdmitting && to == State::kCopying) ||
         (from == State::kCopying && to == State::kSending) ||
         (from == State::kSending && to == State::kCopying);
}

// Reads the request, resolves the range and asks for a window's memory; the admission's
// callback goes on.
absl::Status ExportHeadReactor::Start(const grpc::ByteBuffer& raw_request) {
  v1::ExportHeadRequest request;
  auto part_bytes =
      ReadStreamedRequest(raw_request, "ExportHead", service_->options(), &request);
  if (!part_bytes.ok()) return part_bytes.status();
  part_bytes_ = *part_bytes;
  head_ = request.head();
  principal_ = service_->Principal(ctx_);
  LOSSD_RETURN_IF_ERROR(service_->engine()->heads().CheckInstance(
      head_, request.head_instance(), "ExportHeadRequest.head_instance", principal_));
  if (request.has_version()) version_ = request.version();
  auto range = service_->engine()->heads().CheckExport(
      head_, version_, request.range_begin(), request.range_end(), principal_);
  if (!range.ok()) return range.status();
  std::tie(begin_, end_) = *range;
  offset_ = begin_;
  const uint64_t budget = service_->engine()->budget().budget();
  window_bytes_ = std::min({end_ - begin_, kExportWindowBytes, budget});
  if (window_bytes_ == 0 && end_ > begin_) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "exporting head '", ClippedText(head_), "' needs host memory for its copy, and the "
        "memory budget is 0 bytes (--memory_budget_bytes)"));
  }
  state_.Set(State::kAdmitting);
  const std::string what = absl::StrCat("ExportHead of bytes [", begin_, ", ", end_,
                                        ") of head '", ClippedText(head_), "'");
  return admission_.Request(window_bytes_, what,
                            [this](absl::Status st) { OnAdmitted(std::move(st)); });
}

void ExportHeadReactor::OnCancel() {
  // gRPC may run OnCancel from its own uninstrumented code; it returns before OnDone runs.
  LOSSD_TSAN_RELEASE_ON_EXIT(this);
  // Still waiting for memory: withdrawn, its callback fails the call with CANCELLED. Once
  // granted, the copy job or a failed write ends the call.
  admission_.Withdraw();
}

void ExportHeadReactor::OnWriteDone(bool ok) {
  edge_.idle()->WriteDone();
  if (!ok) {
    FinishOnce(edge_.WriteFailed("the client went away while the head was sent"));
    return;
  }
  SendNext();
}

void ExportHeadReactor::OnDone() {
  LOSSD_TSAN_ACQUIRE(this);  // every other reaction has returned (see OnCancel)
  edge_.Unwatch();
  LOSSD_TSAN_RELEASE(service_);  // the server's shutdown returns after every OnDone
  delete this;
}

// Runs once, from Request or from whichever thread released the memory it waited for.
void ExportHeadReactor::OnAdmitted(absl::Status s) {
  if (!s.ok()) {
    FinishOnce(s);
    return;
  }
  state_.Set(State::kCopying);
  service_->engine()->Submit([this] { CopyWindow(); });
}

// On the executor: copies the next window (after every Compute and step queued before it).
void ExportHeadReactor::CopyWindow() {
  if (ctx_->IsCancelled()) {
    FinishOnce(absl::CancelledError("the ExportHead was cancelled"));
    return;
  }
  const uint64_t end = std::min(end_, offset_ + window_bytes_);
  auto r = service_->engine()->heads().Export(head_, version_, offset_, end, principal_);
  if (!r.ok()) {
    FinishOnce(r.status());
    return;
  }
  window_begin_ = r->begin;
  window_end_ = r->end;
  window_ = std::make_shared<std::vector<HostBuffer>>();
  window_->push_back(std::move(r->data));
  state_.Set(State::kSending);
  if (!version_.has_value()) {
    // The first window: every later one must be of the same version.
    version_ = r->head.version;
  }
  if (starts_.empty()) {
    SendHeader(*r);
    return;
  }
  SendNext();
}

void ExportHeadReactor::SendHeader(const HeadExportRange& r) {
  v1::ExportHeadResponse response;
  v1::ExportHeader* h = response.mutable_header();
  *h->mutable_head() = HeadHeaderToWire(HeadStore::SpecOf(r.head));
  uint64_t start = 0;
  for (const auto& [tensor, bytes] : r.tensors) {
    h->add_tensors(HeadTensorToWire(tensor));
    *h->add_specs() = HeadTensorSpec(tensor, r.head.v, r.head.h, r.head.dtype);
    starts_.emplace_back(tensor, start);
    start += bytes;
  }
  starts_.emplace_back(HeadTensor::kCount, start);  // the end of the last tensor
  h->set_range_begin(begin_);
  h->set_range_end(end_);
  h->set_instance(service_->options().instance);
  response_ = wire::EncodeMessage(response);
  Write();
}

// Sends the window's bytes as parts of their tensors (a part never straddles two), then asks
// for the next window, or finishes.
void ExportHeadReactor::SendNext() {
  if (offset_ >= window_end_) {
    window_.reset();  // back to the pool once gRPC has released every slice of it
    if (offset_ >= end_) {
      service_->metrics()->AddBytesOut(static_cast<double>(end_ - begin_));
      FinishOnce(absl::OkStatus());
      return;
    }
    state_.Set(State::kCopying);
    service_->engine()->Submit([this] { CopyWindow(); });
    return;
  }
  // The tensor holding offset_: the last start at or before it.
  size_t i = 0;
  while (i + 2 < starts_.size() && starts_[i + 1].second <= offset_) ++i;
  const uint64_t tensor_end = std::min(window_end_, starts_[i + 1].second);
  const uint64_t n = std::min<uint64_t>(part_bytes_, tensor_end - offset_);
  response_ = wire::EncodePartSlice(
      HeadTensorToWire(starts_[i].first), offset_ - starts_[i].second,
      OutputSlice(window_, (*window_)[0].get() + (offset_ - window_begin_), n));
  offset_ += n;
  Write();
}

// Every response message goes out here: the client has --stream_idle_timeout to take it.
void ExportHeadReactor::Write() {
  edge_.idle()->WriteStarted();
  StartWrite(&response_);
}

void ExportHeadReactor::FinishOnce(const absl::Status& s) {
  if (!state_.Finish()) return;
  window_.reset();
  admission_.Release();
  Finish(edge_.End(s, 0, offset_ > begin_ ? offset_ - begin_ : 0));
}

}  // namespace lossd
