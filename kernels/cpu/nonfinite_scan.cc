// SPDX-License-Identifier: Apache-2.0
#include "kernels/cpu/nonfinite_scan.h"

namespace lossd {
namespace {

// An element is NaN or Inf exactly when all its exponent bits are set. No early exit: the
// loop stays branch-free (and vectorised); a bad tensor is the rare case.
template <typename Bits>
bool AnyAllOnes(const Bits* p, int64_t n, Bits mask) {
  Bits hit = 0;
  for (int64_t i = 0; i < n; ++i) hit |= static_cast<Bits>((p[i] & mask) == mask);
  return hit != 0;
}

}  // namespace

bool AnyNonFinite(const void* data, DType dtype, int64_t first, int64_t n) {
  if (n <= 0) return false;
  switch (dtype) {
    case DType::kF32:
      return AnyAllOnes(static_cast<const uint32_t*>(data) + first, n, uint32_t{0x7F800000u});
    case DType::kBF16:
      return AnyAllOnes(static_cast<const uint16_t*>(data) + first, n, uint16_t{0x7F80u});
    case DType::kF16:
      return AnyAllOnes(static_cast<const uint16_t*>(data) + first, n, uint16_t{0x7C00u});
    default:
      return false;
  }
}

}  // namespace lossd
