// SPDX-License-Identifier: Apache-2.0
// Tests of core/dtype.h: bf16 and fp16 conversions against known bit patterns (round to
// nearest even, subnormals, overflow, infinities, NaN), exhaustive round trips, and random
// floats against independent oracles (F16C hardware for fp16, exact scaling for bf16).
#include "core/dtype.h"

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace lossd {
namespace {

float FromBits(uint32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

uint32_t Bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}

TEST(DTypeTest, SizesAndNames) {
  EXPECT_EQ(DTypeSize(DType::kBF16), 2u);
  EXPECT_EQ(DTypeSize(DType::kF16), 2u);
  EXPECT_EQ(DTypeSize(DType::kF32), 4u);
  EXPECT_EQ(DTypeSize(DType::kI32), 4u);
  EXPECT_EQ(DTypeSize(DType::kI64), 8u);
  EXPECT_EQ(DTypeName(DType::kBF16), "bf16");
  EXPECT_EQ(DTypeName(DType::kF16), "fp16");
  EXPECT_TRUE(IsFloatDType(DType::kF32));
  EXPECT_FALSE(IsFloatDType(DType::kI64));
}

TEST(DTypeTest, Bf16KnownPatterns) {
  EXPECT_EQ(Bf16ToFloat(0x3F80), 1.0f);
  EXPECT_EQ(Bf16ToFloat(0xC000), -2.0f);
  EXPECT_EQ(Bf16ToFloat(0x7F80), std::numeric_limits<float>::infinity());
  EXPECT_EQ(Bf16ToFloat(0xFF80), -std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isnan(Bf16ToFloat(0x7FC0)));
  EXPECT_EQ(Bf16ToFloat(0x0001), std::ldexp(1.0f, -133));  // smallest subnormal

  EXPECT_EQ(FloatToBf16(1.0f), 0x3F80);
  EXPECT_EQ(FloatToBf16(-1.5f), 0xBFC0);
  EXPECT_EQ(FloatToBf16(FromBits(0x3F808000)), 0x3F80);  // 1 + 2^-8: tie, to even (down)
  EXPECT_EQ(FloatToBf16(FromBits(0x3F818000)), 0x3F82);  // 1 + 3 2^-8: tie, to even (up)
  EXPECT_EQ(FloatToBf16(FromBits(0x3F808001)), 0x3F81);  // just above the tie
  EXPECT_EQ(FloatToBf16(FromBits(0x3F807FFF)), 0x3F80);  // just below the tie
  EXPECT_EQ(FloatToBf16(std::numeric_limits<float>::max()), 0x7F80);  // rounds to inf
  EXPECT_EQ(FloatToBf16(FromBits(0x7F7F7FFF)), 0x7F7F);  // largest finite stays finite
  EXPECT_EQ(FloatToBf16(std::numeric_limits<float>::infinity()), 0x7F80);
  EXPECT_EQ(FloatToBf16(-std::numeric_limits<float>::infinity()), 0xFF80);
  EXPECT_EQ(FloatToBf16(-0.0f), 0x8000);
  // Subnormals: exact, and ties to even.
  EXPECT_EQ(FloatToBf16(FromBits(0x00010000)), 0x0001);
  EXPECT_EQ(FloatToBf16(FromBits(0x00008000)), 0x0000);
  EXPECT_EQ(FloatToBf16(FromBits(0x00018000)), 0x0002);
  EXPECT_EQ(FloatToBf16(FromBits(0x007FFFFF)), 0x0080);  // largest fp32 subnormal: up to 2^-126
  // NaN stays NaN, quiet NaN and signalling NaN alike (a plain truncation would make the
  // signalling 0x7F800001 an infinity).
  EXPECT_EQ(FloatToBf16(FromBits(0x7FC00000)), 0x7FC0);
  const uint16_t s = FloatToBf16(FromBits(0x7F800001));
  EXPECT_TRUE(std::isnan(Bf16ToFloat(s))) << std::hex << s;
  EXPECT_TRUE(std::isnan(Bf16ToFloat(FloatToBf16(FromBits(0xFFFFFFFF)))));
}

TEST(DTypeTest, F16KnownPatterns) {
  EXPECT_EQ(F16ToFloat(0x3C00), 1.0f);
  EXPECT_EQ(F16ToFloat(0xC000), -2.0f);
  EXPECT_EQ(F16ToFloat(0x7BFF), 65504.0f);
  EXPECT_EQ(F16ToFloat(0x0400), std::ldexp(1.0f, -14));    // smallest normal
  EXPECT_EQ(F16ToFloat(0x0001), std::ldexp(1.0f, -24));    // smallest subnormal
  EXPECT_EQ(F16ToFloat(0x03FF), 1023 * std::ldexp(1.0f, -24));  // largest subnormal
  EXPECT_EQ(F16ToFloat(0x8001), -std::ldexp(1.0f, -24));
  EXPECT_EQ(F16ToFloat(0x7C00), std::numeric_limits<float>::infinity());
  EXPECT_EQ(F16ToFloat(0xFC00), -std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isnan(F16ToFloat(0x7E00)));
  EXPECT_TRUE(std::isnan(F16ToFloat(0x7C01)));
  EXPECT_EQ(Bits(F16ToFloat(0x8000)), 0x80000000u);  // -0

  EXPECT_EQ(FloatToF16(1.0f), 0x3C00);
  EXPECT_EQ(FloatToF16(65504.0f), 0x7BFF);
  EXPECT_EQ(FloatToF16(65519.996f), 0x7BFF);  // below the tie with 65536
  EXPECT_EQ(FloatToF16(65520.0f), 0x7C00);    // tie: to even, which is infinity
  EXPECT_EQ(FloatToF16(1e10f), 0x7C00);
  EXPECT_EQ(FloatToF16(-1e10f), 0xFC00);
  EXPECT_EQ(FloatToF16(1.0f + std::ldexp(1.0f, -11)), 0x3C00);      // tie, to even (down)
  EXPECT_EQ(FloatToF16(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3C02);  // tie, to even (up)
  EXPECT_EQ(FloatToF16(std::ldexp(1.0f, -24)), 0x0001);
  EXPECT_EQ(FloatToF16(std::ldexp(1.0f, -25)), 0x0000);  // tie with 0: to even
  EXPECT_EQ(FloatToF16(std::nextafter(std::ldexp(1.0f, -25), 1.0f)), 0x0001);
  EXPECT_EQ(FloatToF16(3 * std::ldexp(1.0f, -25)), 0x0002);  // tie between 1 and 2: even
  EXPECT_EQ(FloatToF16(std::ldexp(1.0f, -14) * (1 - std::ldexp(1.0f, -12))), 0x0400);
  EXPECT_EQ(FloatToF16(1e-30f), 0x0000);
  EXPECT_EQ(FloatToF16(-1e-30f), 0x8000);
  EXPECT_EQ(FloatToF16(-0.0f), 0x8000);
  EXPECT_EQ(FloatToF16(std::numeric_limits<float>::infinity()), 0x7C00);
  EXPECT_TRUE(std::isnan(F16ToFloat(FloatToF16(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_TRUE(std::isnan(F16ToFloat(FloatToF16(FromBits(0x7F800001)))));
}

TEST(DTypeTest, EveryBf16AndF16ValueRoundTrips) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float b = Bf16ToFloat(static_cast<uint16_t>(h));
    if (std::isnan(b)) {
      EXPECT_TRUE(std::isnan(Bf16ToFloat(FloatToBf16(b)))) << std::hex << h;
    } else {
      EXPECT_EQ(FloatToBf16(b), h) << std::hex << h;
    }
    const float f = F16ToFloat(static_cast<uint16_t>(h));
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(F16ToFloat(FloatToF16(f)))) << std::hex << h;
    } else {
      EXPECT_EQ(FloatToF16(f), h) << std::hex << h;
    }
  }
}

// Round to nearest even with 8 significant bits, by exact scaling: the independent oracle.
float Bf16Oracle(float f) {
  if (std::isnan(f) || std::isinf(f) || f == 0) return f;
  int e = std::ilogb(f);
  if (e < -126) e = -126;  // subnormal: the quantum stays 2^-133
  const double q = std::ldexp(1.0, e - 7);
  const double r = std::nearbyint(static_cast<double>(f) / q) * q;
  if (std::fabs(r) > std::numeric_limits<float>::max()) {
    return std::copysign(std::numeric_limits<float>::infinity(), f);
  }
  return static_cast<float>(r);
}

__attribute__((target("f16c"))) uint16_t F16Hardware(float f) {
  return static_cast<uint16_t>(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT));
}

TEST(DTypeTest, RandomFloatsMatchIndependentOracles) {
  const bool f16c = __builtin_cpu_supports("f16c");
  std::mt19937 rng(123);
  int64_t checked = 0;
  for (int k = 0; k < 2000000; ++k) {
    uint32_t b = rng();
    if (k % 4 == 1) b = (b & 0x8000FFFFu) | 0x3F800000u;  // near 1: many ties
    if (k % 4 == 2) b &= 0x80FFFFFFu;                    // tiny and subnormal
    if (k % 4 == 3) b = (b & 0x807FFFFFu) | ((0x66u + (rng() % 0x30u)) << 23);  // fp16 range
    const float f = FromBits(b);
    if (std::isnan(f)) continue;
    const float want = Bf16Oracle(f);
    const float got = Bf16ToFloat(FloatToBf16(f));
    ASSERT_EQ(Bits(got), Bits(want)) << std::hex << "input bits " << b;
    if (f16c) {
      ASSERT_EQ(FloatToF16(f), F16Hardware(f)) << std::hex << "input bits " << b;
    }
    ++checked;
  }
  EXPECT_GT(checked, 1900000);
}

TEST(DTypeTest, LoadAndStoreByDType) {
  std::vector<uint8_t> buf(3 * 4);
  for (DType t : {DType::kBF16, DType::kF16, DType::kF32}) {
    StoreFromFloat(buf.data(), t, 2, -3.25f);
    EXPECT_EQ(LoadAsFloat(buf.data(), t, 2), -3.25f) << DTypeName(t);
  }
  StoreFromFloat(buf.data(), DType::kBF16, 0, 1.0f + std::ldexp(1.0f, -9));
  EXPECT_EQ(LoadAsFloat(buf.data(), DType::kBF16, 0), 1.0f);
  const int32_t i32[2] = {-100, 7};
  const int64_t i64[2] = {int64_t{1} << 40, -1};
  EXPECT_EQ(LoadAsInt(i32, DType::kI32, 0), -100);
  EXPECT_EQ(LoadAsInt(i32, DType::kI32, 1), 7);
  EXPECT_EQ(LoadAsInt(i64, DType::kI64, 0), int64_t{1} << 40);
  EXPECT_EQ(LoadAsInt(i64, DType::kI64, 1), -1);
}

}  // namespace
}  // namespace lossd
