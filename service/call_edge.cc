// SPDX-License-Identifier: Apache-2.0
#include "service/call_edge.h"

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "service/reactor_common.h"

namespace lossd {

CallEdge::CallEdge(LossService* service, grpc::CallbackServerContext* ctx, const char* method)
    : service_(service),
      ctx_(ctx),
      method_(method),
      started_(absl::Now()),
      request_id_(BeginRequestId(ctx)),
      idle_(service->idle_watch().Watch([ctx] { ctx->TryCancel(); })) {}

absl::Status CallEdge::Enter() {
  absl::Status s = service_->Enter(ctx_, method_, &client_);
  entered_ = s.ok();
  return s;
}

grpc::Status CallEdge::End(const absl::Status& s, uint64_t bytes_in, uint64_t bytes_out) {
  grpc::Status g =
      RecordCall(service_, *ctx_, method_, request_id_, started_, s, bytes_in, bytes_out);
  if (entered_) service_->Leave(client_);
  return g;
}

void CallEdge::Unwatch() { service_->idle_watch().Unwatch(idle_); }

absl::Status CallEdge::WriteFailed(absl::string_view gone) const {
  if (idle_->expired()) {
    return absl::DeadlineExceededError(
        absl::StrCat("the ", method_, " was cancelled by the server: ", idle_->Reason()));
  }
  return absl::CancelledError(gone);
}

absl::Status CallEdge::CountPart(uint64_t size) {
  const ServiceOptions& o = service_->options();
  if (++parts_ > o.max_parts_per_request) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the stream sent more than --max_parts_per_request=", o.max_parts_per_request,
        " parts; send larger parts"));
  }
  if (size > o.max_part_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a part carries ", size, " bytes, more than --max_part_bytes=", o.max_part_bytes));
  }
  return absl::OkStatus();
}

}  // namespace lossd
