// SPDX-License-Identifier: Apache-2.0
// Conversions between the hosted-head messages of lossd.v1 (HeadHeader, StepRequest,
// StepResponse, HeadInfo, ExportHeader, the TENSOR_HEAD_* ids) and engine/heads.h's plain
// types. Resolves torch's optimizer defaults and refuses what the engine's types cannot say
// (a missing field, an optimizer field of the other kind); every range and limit is the
// engine's to check.
#ifndef LOSSD_SERVICE_HEAD_WIRE_H_
#define LOSSD_SERVICE_HEAD_WIRE_H_

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "engine/heads.h"
#include "engine/owner.h"
#include "lossd/v1/lossd.pb.h"

namespace lossd {

// HeadHeader -> HeadSpec. `field` prefixes messages ("header"). OPTIMIZER_UNSPECIFIED, a
// missing or non-2-D w, a bias that is not (V) in w's dtype and an unspecified compute_dtype
// are INVALID_ARGUMENT naming the field.
absl::StatusOr<HeadSpec> HeadSpecFromWire(const v1::HeadHeader& h, absl::string_view field);
// The inverse, for ExportHeader.head (what CreateHead takes to import an export).
v1::HeadHeader HeadHeaderToWire(const HeadSpec& spec);

// torch's defaults filled in: lr 1e-3; weight_decay SGD 0, AdamW 0.01; betas (0.9, 0.999);
// eps 1e-8.
absl::StatusOr<HeadOptimizer> OptimizerFromWire(const v1::OptimizerConfig& c,
                                                absl::string_view field);
// Every field set (the optional ones too), so a reader sees the values in use.
v1::OptimizerConfig OptimizerToWire(const HeadOptimizer& o);

absl::StatusOr<StepCall> StepCallFromWire(const v1::StepRequest& r);
v1::StepResponse StepResponseToWire(const StepResult& r, const std::string& instance);

v1::HeadInfo HeadInfoToWire(const HeadSummary& s, const std::string& instance);

// TENSOR_HEAD_* <-> HeadTensor. FromWire refuses every other id (INVALID_ARGUMENT naming
// `field` and the id).
absl::StatusOr<HeadTensor> HeadTensorFromWire(v1::TensorId id, absl::string_view field);
v1::TensorId HeadTensorToWire(HeadTensor t);
// A head tensor's spec: fp32 (the copy: `copy_dtype`), (V, H) for W's tensors, (V) for the
// bias's.
v1::TensorSpec HeadTensorSpec(HeadTensor t, int64_t v, int64_t h, DType copy_dtype);

// List's entry for one piece of state (weight handle, accumulator or head).
void StateEntryToWire(const StateInfo& s, v1::StateEntry* e);

}  // namespace lossd

#endif  // LOSSD_SERVICE_HEAD_WIRE_H_
