// SPDX-License-Identifier: Apache-2.0
#include "engine/finite_check.h"

#include <cmath>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"

namespace lossd {
namespace {

// True when any element is Inf or NaN: an all-ones exponent. Works on the raw bits with no
// branch per element (a per-element float conversion took 40% of the server's CPU on large
// uploads), in blocks of a fixed element count: gcc's -O2 vectoriser takes only loops with a
// known trip count, so the block loop is vectorised where one loop over n is not (a 64 MiB
// bf16 X: 31 ms -> 4 ms on the 2-core development machine).
template <typename Bits>
bool AnyNonFinite(const uint8_t* data, uint64_t n, Bits exponent_mask) {
  constexpr uint64_t kBlock = 512 / sizeof(Bits);
  Bits hit = 0;
  uint64_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    Bits block[kBlock];
    std::memcpy(block, data + i * sizeof(Bits), sizeof(block));  // unaligned parts
    for (uint64_t j = 0; j < kBlock; ++j) {
      hit |= static_cast<Bits>((block[j] & exponent_mask) == exponent_mask);
    }
    if (hit != 0) return true;
  }
  for (; i < n; ++i) {
    Bits b;
    std::memcpy(&b, data + i * sizeof(Bits), sizeof(b));
    hit |= static_cast<Bits>((b & exponent_mask) == exponent_mask);
  }
  return hit != 0;
}

// Element i of a float tensor (bf16, fp16, fp32) as fp32, read through memcpy: like the
// fast path, the slow one may see a part's data at any byte address (LoadAsFloat's typed
// load of a misaligned element is undefined behaviour).
float LoadFloatUnaligned(const uint8_t* data, DType dtype, uint64_t i) {
  if (dtype == DType::kF32) {
    float f;
    std::memcpy(&f, data + i * sizeof(f), sizeof(f));
    return f;
  }
  uint16_t h;
  std::memcpy(&h, data + i * sizeof(h), sizeof(h));
  return dtype == DType::kBF16 ? Bf16ToFloat(h) : F16ToFloat(h);
}

// Elements [0, n) of `data` are elements [first, first + n) of the tensor `name` (for the
// index in the message).
absl::Status CheckFinite(const uint8_t* data, DType dtype, uint64_t n, const char* name,
                         int64_t cols, uint64_t first = 0) {
  bool any = false;
  switch (dtype) {
    case DType::kBF16: any = AnyNonFinite<uint16_t>(data, n, 0x7f80u); break;
    case DType::kF16: any = AnyNonFinite<uint16_t>(data, n, 0x7c00u); break;
    case DType::kF32: any = AnyNonFinite<uint32_t>(data, n, 0x7f800000u); break;
    default: return absl::OkStatus();
  }
  if (!any) return absl::OkStatus();
  for (uint64_t i = 0; i < n; ++i) {  // the slow path only finds where
    const float f = LoadFloatUnaligned(data, dtype, i);
    if (!std::isfinite(f)) {
      const uint64_t at = first + i;
      std::string where = cols > 0 ? absl::StrCat("[", at / cols, ", ", at % cols, "]")
                                   : absl::StrCat("[", at, "]");
      return absl::InvalidArgumentError(absl::StrCat(
          name, " contains a non-finite value (", std::isnan(f) ? "nan" : "inf", ") at ",
          where, "; lossd refuses NaN and Inf inputs (--check_finite)"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckFiniteElements(const uint8_t* tensor, DType dtype, uint64_t first, uint64_t n,
                                 const char* name, int64_t cols) {
  return CheckFinite(tensor + first * DTypeSize(dtype), dtype, n, name, cols, first);
}

}  // namespace lossd
