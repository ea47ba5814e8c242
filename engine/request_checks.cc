// SPDX-License-Identifier: Apache-2.0
#include "engine/request_checks.h"

#include "absl/strings/str_cat.h"
#include "core/dtype.h"
#include "engine/message_bounds.h"

namespace lossd {

std::string ShapeString(const std::vector<int64_t>& shape) { return ShapeText(shape); }

uint64_t NumElements(const std::vector<int64_t>& shape) {
  uint64_t n = 1;
  for (int64_t d : shape) n *= static_cast<uint64_t>(d);
  return n;
}

absl::Status CheckShape(const TensorDesc& t, const char* name, size_t rank) {
  if (t.shape.size() != rank) {
    return absl::InvalidArgumentError(absl::StrCat(name, ".shape must have ", rank,
                                                   " dimensions, got ", ShapeString(t.shape)));
  }
  uint64_t n = 1;
  for (int64_t d : t.shape) {
    if (d <= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, ".shape ", ShapeString(t.shape), " has a dimension <= 0"));
    }
    if (static_cast<uint64_t>(d) > (uint64_t{1} << 40) / n) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, ".shape ", ShapeString(t.shape), " is too large"));
    }
    n *= static_cast<uint64_t>(d);
  }
  return absl::OkStatus();
}

absl::Status CheckFloatDType(const TensorDesc& t, const char* name) {
  if (!IsFloatDType(t.dtype)) {
    return absl::InvalidArgumentError(absl::StrCat(
        name, ".dtype must be bf16, fp16 or fp32, got ", DTypeName(t.dtype)));
  }
  return absl::OkStatus();
}

absl::Status CheckIdLength(const std::string& id, absl::string_view field) {
  if (id.size() <= kMaxIdLength) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(field, " is ", id.size(),
                                                 " characters long, more than any issued (",
                                                 kMaxIdLength, ")"));
}

absl::Status PartialSumError(const std::string& name) {
  return absl::FailedPreconditionError(absl::StrCat(
      "accumulator '", name, "' may hold a partial sum: a micro-batch failed while adding "
      "into it; drop it and redo the step"));
}

}  // namespace lossd
