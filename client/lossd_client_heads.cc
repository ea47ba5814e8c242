// SPDX-License-Identifier: Apache-2.0
// LossClient's hosted-head calls (CreateHead .. DropHead) and the head -> instance memory
// they keep; the tensor calls are in lossd_client.cc.
#include <string>

#include "absl/synchronization/mutex.h"
#include "client/head_calls.h"
#include "client/head_export.h"
#include "client/lossd_client.h"
#include "client/lossd_client_internal.h"
#include "core/status_macros.h"
#include "lossd/v1/lossd.grpc.pb.h"
#include "lossd/v1/lossd.pb.h"

namespace lossd {
namespace client {

using internal::CallUnary;

std::string LossClient::HeadInstance(const std::string& head) const {
  absl::MutexLock lock(&instances_mu_);
  auto it = head_instances_.find(head);
  return it == head_instances_.end() ? std::string() : it->second;
}

void LossClient::RememberHeadInstance(const std::string& head, const std::string& instance) {
  absl::MutexLock lock(&instances_mu_);
  if (instance.empty()) {
    head_instances_.erase(head);
    return;
  }
  if (head_instances_.size() >= kRememberedAccumulators && head_instances_.count(head) == 0) {
    head_instances_.erase(head_instances_.begin());
  }
  head_instances_[head] = instance;
}

absl::StatusOr<CreateHeadResult> LossClient::CreateHead(const CreateHeadRequest& r,
                                                        const CallOptions& call) {
  LOSSD_RETURN_IF_ERROR(ValidateCreateHead(r));
  LOSSD_RETURN_IF_ERROR(RequireFeature(kHostedHeadFeature, call));
  LOSSD_ASSIGN_OR_RETURN(CreateHeadResult res, RunCreateHead(NextConnection().generic.get(),
                                                             Preparer(call), r,
                                                             options_.part_bytes));
  RememberHeadInstance(r.name, res.head.instance);
  return res;
}

absl::StatusOr<CreateHeadResult> LossClient::ImportHead(const HeadExport& e,
                                                        const CallOptions& call) {
  LOSSD_ASSIGN_OR_RETURN(CreateHeadRequest r, ImportRequestOf(e));
  return CreateHead(r, call);
}

absl::StatusOr<CreateHeadResult> LossClient::ImportHead(const HeadExport& e,
                                                        const HeadGroup& group,
                                                        const CallOptions& call) {
  LOSSD_ASSIGN_OR_RETURN(CreateHeadRequest r, ImportRequestOf(e));
  r.group = group;
  return CreateHead(r, call);
}

absl::StatusOr<StepResult> LossClient::Step(const StepRequest& r, const CallOptions& call) {
  LOSSD_RETURN_IF_ERROR(ValidateStep(r));
  LOSSD_RETURN_IF_ERROR(RequireFeature(kHostedHeadFeature, call));
  v1::StepResponse resp;
  LOSSD_RETURN_IF_ERROR(CallUnary(NextConnection().stub.get(), &v1::Loss::Stub::Step,
                                  Preparer(call), StepRequestOf(r, HeadInstance(r.head)), &resp));
  return StepResultFromProto(resp);
}

absl::StatusOr<HeadExport> LossClient::ExportHead(const std::string& head,
                                                  const ExportHeadOptions& options,
                                                  const CallOptions& call) {
  LOSSD_RETURN_IF_ERROR(RequireFeature(kHostedHeadFeature, call));
  const ExportCall ec{head, HeadInstance(head), options_.response_part_bytes, options};
  return RunExportToTensors(NextConnection().generic.get(), Preparer(call), ec);
}

absl::StatusOr<HeadExport> LossClient::ExportHeadTo(
    const std::string& head, const std::function<absl::Status(const HeadExport&)>& on_layout,
    const HeadExportSink& sink, const ExportHeadOptions& options, const CallOptions& call) {
  LOSSD_RETURN_IF_ERROR(RequireFeature(kHostedHeadFeature, call));
  const ExportCall ec{head, HeadInstance(head), options_.response_part_bytes, options};
  return RunExport(NextConnection().generic.get(), Preparer(call), ec, on_layout, sink);
}

absl::StatusOr<HeadInfo> LossClient::GetHeadInfo(const std::string& head,
                                                 const CallOptions& call) {
  LOSSD_RETURN_IF_ERROR(ValidateHeadName(head, "head"));
  LOSSD_RETURN_IF_ERROR(RequireFeature(kHostedHeadFeature, call));
  v1::HeadRequest req;
  req.set_head(head);
  v1::HeadInfo resp;
  LOSSD_RETURN_IF_ERROR(CallUnary(NextConnection().stub.get(), &v1::Loss::Stub::GetHeadInfo,
                                  Preparer(call), req, &resp));
  LOSSD_ASSIGN_OR_RETURN(HeadInfo info, HeadInfoFromProto(resp));
  RememberHeadInstance(head, info.instance);
  return info;
}

absl::Status LossClient::DropHead(const std::string& head, const CallOptions& call) {
  LOSSD_RETURN_IF_ERROR(ValidateHeadName(head, "head"));
  RememberHeadInstance(head, "");
  LOSSD_RETURN_IF_ERROR(RequireFeature(kHostedHeadFeature, call));
  v1::HeadRequest req;
  req.set_head(head);
  v1::DropHeadResponse resp;
  return CallUnary(NextConnection().stub.get(), &v1::Loss::Stub::DropHead, Preparer(call), req,
                   &resp);
}

}  // namespace client
}  // namespace lossd
