// SPDX-License-Identifier: Apache-2.0
// Host scan for NaN and Inf in a float tensor (bf16, fp16, fp32), by the exponent bits alone,
// so the compiler vectorises it and it reads each byte once. Never writes, never allocates.
#ifndef LOSSD_KERNELS_CPU_NONFINITE_SCAN_H_
#define LOSSD_KERNELS_CPU_NONFINITE_SCAN_H_

#include <cstdint>

#include "core/dtype.h"

namespace lossd {

// True when any of elements [first, first + n) of `data` is NaN or Inf. Other dtypes: false.
bool AnyNonFinite(const void* data,  // (first + n) dtype
                  DType dtype, int64_t first, int64_t n);

}  // namespace lossd

#endif  // LOSSD_KERNELS_CPU_NONFINITE_SCAN_H_
