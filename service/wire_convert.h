// SPDX-License-Identifier: Apache-2.0
// Conversions between the wire (lossd.v1 protobuf messages) and the engine's plain types.
// Every refusal names the header field and the value it got.
#ifndef LOSSD_SERVICE_WIRE_CONVERT_H_
#define LOSSD_SERVICE_WIRE_CONVERT_H_

#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/dtype.h"
#include "core/loss_problem.h"
#include "lossd/v1/lossd.pb.h"
#include "engine/compute_plan.h"

namespace lossd {

absl::StatusOr<DType> DTypeFromWire(v1::DType d, absl::string_view field);
v1::DType DTypeToWire(DType d);

// `field` prefixes messages, e.g. "header.x". Absent specs give present = false.
absl::StatusOr<TensorDesc> TensorDescFromWire(bool present, const v1::TensorSpec& spec,
                                              absl::string_view field);
v1::TensorSpec TensorSpecToWire(DType dtype, const std::vector<int64_t>& shape);

absl::StatusOr<ComputeSpec> ComputeSpecFromWire(const v1::ComputeHeader& h);

// Input tensor ids of a Compute stream; INVALID_ARGUMENT for outputs and unknown ids.
absl::StatusOr<InputSlot> InputSlotFromWire(v1::TensorId id);
v1::TensorId OutputSlotToWire(OutputSlot s);

// LossStats' NonFiniteBits as the tensors ComputeSummary.nonfinite names, in tensor order.
std::vector<v1::TensorId> NonFiniteToWire(uint32_t bits);

}  // namespace lossd

#endif  // LOSSD_SERVICE_WIRE_CONVERT_H_
