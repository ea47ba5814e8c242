// SPDX-License-Identifier: Apache-2.0
// The engine's checks of what a request describes, shared by its planning, weight uploads
// and accumulator calls: tensor descriptions (rank, positive dimensions, a bounded element
// count, float dtypes), the length of ids echoed in messages, and the refusal of a partial
// sum. Messages name the client's field; a client's shape is printed bounded. Reads no data.
#ifndef LOSSD_ENGINE_REQUEST_CHECKS_H_
#define LOSSD_ENGINE_REQUEST_CHECKS_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "engine/compute_plan.h"

namespace lossd {

// A client's shape for a message, bounded (message_bounds.h: it may have any rank).
std::string ShapeString(const std::vector<int64_t>& shape);

// The product of the dimensions (of a shape CheckShape accepted: it cannot overflow).
uint64_t NumElements(const std::vector<int64_t>& shape);

// `rank` dimensions, each positive, at most 2^40 elements in all; INVALID_ARGUMENT naming
// "<name>.shape" otherwise.
absl::Status CheckShape(const TensorDesc& t, const char* name, size_t rank);

// bf16, fp16 or fp32; INVALID_ARGUMENT naming "<name>.dtype" otherwise.
absl::Status CheckFloatDType(const TensorDesc& t, const char* name);

// Handles and instance ids are short (w-<instance>-<n>, 8 hex digits); one of any length
// would be echoed whole in the error that answers it, and a status message past gRPC's
// metadata limit reaches the client as another error. INVALID_ARGUMENT past kMaxIdLength.
inline constexpr size_t kMaxIdLength = 128;
absl::Status CheckIdLength(const std::string& id, absl::string_view field);

// FAILED_PRECONDITION: accumulator `name` may hold a partial sum (a micro-batch failed while
// adding into it), so it is never served as whole.
absl::Status PartialSumError(const std::string& name);

}  // namespace lossd

#endif  // LOSSD_ENGINE_REQUEST_CHECKS_H_
