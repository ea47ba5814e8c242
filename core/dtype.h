// SPDX-License-Identifier: Apache-2.0
// Element types lossd moves and computes with, and exact host-side conversions for the 16-bit
// float formats. Never depends on CUDA, gRPC or protobuf.
#ifndef LOSSD_CORE_DTYPE_H_
#define LOSSD_CORE_DTYPE_H_

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "absl/base/casts.h"
#include "absl/strings/string_view.h"

namespace lossd {

enum class DType : int32_t { kBF16 = 0, kF16 = 1, kF32 = 2, kI32 = 3, kI64 = 4 };

inline size_t DTypeSize(DType t) {
  switch (t) {
    case DType::kBF16:
    case DType::kF16:
      return 2;
    case DType::kF32:
    case DType::kI32:
      return 4;
    case DType::kI64:
      return 8;
  }
  return 0;
}

inline absl::string_view DTypeName(DType t) {
  switch (t) {
    case DType::kBF16:
      return "bf16";
    case DType::kF16:
      return "fp16";
    case DType::kF32:
      return "fp32";
    case DType::kI32:
      return "int32";
    case DType::kI64:
      return "int64";
  }
  return "unknown";
}

inline bool IsFloatDType(DType t) {
  return t == DType::kBF16 || t == DType::kF16 || t == DType::kF32;
}

// bf16 is the top half of an fp32: widening is exact, narrowing rounds to nearest even.
inline float Bf16ToFloat(uint16_t h) {
  return absl::bit_cast<float>(static_cast<uint32_t>(h) << 16);
}

inline uint16_t FloatToBf16(float f) {
  const uint32_t bits = absl::bit_cast<uint32_t>(f);
  if ((bits & 0x7f800000u) == 0x7f800000u && (bits & 0x007fffffu) != 0) {
    return static_cast<uint16_t>((bits >> 16) | 0x0040u);  // keep NaN a NaN
  }
  uint32_t rounding = 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + rounding) >> 16);
}

// IEEE binary16, round to nearest even, with subnormals and infinities.
inline float F16ToFloat(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      int e = -1;
      do {
        ++e;
        mant <<= 1;
      } while ((mant & 0x400u) == 0);
      bits = sign | static_cast<uint32_t>(127 - 15 - e) << 23 | (mant & 0x3ffu) << 13;
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | mant << 13;
  } else {
    bits = sign | (exp + 127 - 15) << 23 | mant << 13;
  }
  return absl::bit_cast<float>(bits);
}

inline uint16_t FloatToF16(float f) {
  const uint32_t bits = absl::bit_cast<uint32_t>(f);
  uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  uint32_t abs = bits & 0x7fffffffu;
  if (abs >= 0x7f800000u) {  // inf or NaN
    return sign | 0x7c00u | (abs > 0x7f800000u ? 0x200u : 0u);
  }
  if (abs >= 0x477ff000u) return sign | 0x7c00u;  // rounds past 65504: inf
  if (abs < 0x38800000u) {                         // below 2^-14: subnormal or zero
    if (abs < 0x33000000u) return sign;            // below half the smallest subnormal
    uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
    int shift = 126 - static_cast<int>(abs >> 23);  // 14 + (113 - exp) - 1 ... into 10 bits
    uint32_t shifted = mant >> (shift);
    uint32_t rem = mant & ((1u << shift) - 1);
    uint32_t half = 1u << (shift - 1);
    uint32_t out = shifted;
    if (rem > half || (rem == half && (shifted & 1u))) ++out;
    return sign | static_cast<uint16_t>(out);
  }
  uint32_t out = ((abs >> 23) - 127 + 15) << 10 | ((abs >> 13) & 0x3ffu);
  uint32_t rem = abs & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (out & 1u))) ++out;
  return sign | static_cast<uint16_t>(out);
}

// Reads element i of a float tensor of dtype t as fp32.
inline float LoadAsFloat(const void* data, DType t, size_t i) {
  switch (t) {
    case DType::kBF16:
      return Bf16ToFloat(static_cast<const uint16_t*>(data)[i]);
    case DType::kF16:
      return F16ToFloat(static_cast<const uint16_t*>(data)[i]);
    case DType::kF32:
      return static_cast<const float*>(data)[i];
    default:
      return 0.0f;
  }
}

// Writes v as element i of a float tensor of dtype t (rounding to nearest even).
inline void StoreFromFloat(void* data, DType t, size_t i, float v) {
  switch (t) {
    case DType::kBF16:
      static_cast<uint16_t*>(data)[i] = FloatToBf16(v);
      break;
    case DType::kF16:
      static_cast<uint16_t*>(data)[i] = FloatToF16(v);
      break;
    case DType::kF32:
      static_cast<float*>(data)[i] = v;
      break;
    default:
      break;
  }
}

// Reads element i of an integer tensor (int32 or int64) as int64.
inline int64_t LoadAsInt(const void* data, DType t, size_t i) {
  return t == DType::kI32 ? static_cast<const int32_t*>(data)[i]
                          : static_cast<const int64_t*>(data)[i];
}

}  // namespace lossd

#endif  // LOSSD_CORE_DTYPE_H_
