// SPDX-License-Identifier: Apache-2.0
// The --check_finite test of float tensors (bf16, fp16, fp32): finds the first NaN or Inf and
// names it. Reads raw bits at any byte alignment, so a part of a tensor can be checked as it
// arrives, off the compute's critical path. Never modifies the data; other dtypes pass.
#ifndef LOSSD_ENGINE_FINITE_CHECK_H_
#define LOSSD_ENGINE_FINITE_CHECK_H_

#include <cstdint>

#include "absl/status/status.h"
#include "core/dtype.h"

namespace lossd {

// The --check_finite test of elements [first, first + n) of a float tensor (bf16, fp16, fp32;
// other dtypes pass) that starts at `tensor`: INVALID_ARGUMENT "<name> contains a non-finite
// value (nan|inf) at [row, col]" (`cols` > 0) or "at [i]" (cols = 0) for the first bad one.
// Lets a receiver check parts as they arrive, off the compute's critical path.
absl::Status CheckFiniteElements(const uint8_t* tensor, DType dtype, uint64_t first, uint64_t n,
                                 const char* name, int64_t cols);  // tensor: whole tensor

}  // namespace lossd

#endif  // LOSSD_ENGINE_FINITE_CHECK_H_
