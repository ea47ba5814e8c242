// SPDX-License-Identifier: Apache-2.0
// The hosted-head calls of the C++ client apart from LossClient: the checks of a CreateHead
// and a Step made before anything is sent, the messages they send, the conversions of what
// comes back, and the CreateHead stream (ExportHead's are in head_export.h). Never retries
// and never decides which connection a call takes: LossClient does.
#ifndef LOSSD_CLIENT_HEAD_CALLS_H_
#define LOSSD_CLIENT_HEAD_CALLS_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/client_types.h"
#include "client/head_types.h"
#include "grpcpp/generic/generic_stub.h"
#include "lossd/v1/lossd.pb.h"

namespace lossd {
namespace client {

inline constexpr char kCreateHeadMethod[] = "/lossd.v1.Loss/CreateHead";

using ContextPreparer = std::function<void(grpc::ClientContext*)>;

// INVALID_ARGUMENT naming the field and the values for a request the server would refuse on
// its face: the name, W's rank and dtype, the bias's shape and dtype, the compute dtype, the
// optimizer's ranges, and the state tensors (exactly StateTensors(), fp32, their shapes).
absl::Status ValidateCreateHead(const CreateHeadRequest& r);
absl::Status ValidateStep(const StepRequest& r);
absl::Status ValidateHeadName(const std::string& name, const char* field);

// Conversions between the client's types and lossd.v1's.
v1::OptimizerConfig OptimizerToProto(const OptimizerOptions& o);
OptimizerOptions OptimizerFromProto(const v1::OptimizerConfig& o);
v1::HeadHeader HeadHeaderOf(const CreateHeadRequest& r);
absl::StatusOr<HeadSpec> HeadSpecFromProto(const v1::HeadHeader& h);
absl::StatusOr<HeadInfo> HeadInfoFromProto(const v1::HeadInfo& h);
v1::StepRequest StepRequestOf(const StepRequest& r, const std::string& instance);
StepResult StepResultFromProto(const v1::StepResponse& s);

// One CreateHead stream: the header, then W, the bias and the state in wire order, parts of
// at most `part_bytes`; the single reply.
absl::StatusOr<CreateHeadResult> RunCreateHead(grpc::GenericStub* stub,
                                               const ContextPreparer& prepare,
                                               const CreateHeadRequest& r, size_t part_bytes);

// The CreateHead request that imports `e` (views of its tensors: `e` outlives the call).
// INVALID_ARGUMENT when a tensor the spec needs is missing.
absl::StatusOr<CreateHeadRequest> ImportRequestOf(const HeadExport& e);

}  // namespace client
}  // namespace lossd

#endif  // LOSSD_CLIENT_HEAD_CALLS_H_
