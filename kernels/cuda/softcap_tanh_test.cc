// SPDX-License-Identifier: Apache-2.0
// The softcap's tanh (softcap_tanh.h) on the host, against long double tanhl. The polynomial
// gives the same bits here as on the GPU (fmaf and round-to-nearest products only), so its
// bound is the GPU's; the exponential form runs here with exact exp2f and division, so this
// checks its formula, and ce_kernels_test checks it as the GPU's approximate instructions
// compute it.
#include "kernels/cuda/softcap_tanh.h"

#include <cmath>
#include <cstdint>
#include <cstring>

#include "gtest/gtest.h"

namespace lossd {
namespace cuda {
namespace {

float FromBits(uint32_t b) {
  float f;
  std::memcpy(&f, &b, sizeof f);
  return f;
}

uint32_t Bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof b);
  return b;
}

// |got - tanh(y)| in units of the last place of the correctly rounded result.
double UlpError(float got, float y) {
  const long double want = tanhl(static_cast<long double>(y));
  const float w = std::fabs(static_cast<float>(want));
  const double ulp = std::nextafter(w, INFINITY) - w;
  return static_cast<double>(std::fabs(static_cast<long double>(got) - want)) / ulp;
}

// Bounds (ulp): the polynomial's fit is 4.7e-9 relative, so its error is the evaluation's
// final rounding plus a little; the exponential form's 2 / (e + 1) term is at most 0.24 of the
// result at |y| >= kTanhNear, so the roundings of 2|y| log2(e), e + 1 and the quotient add at
// most about 0.8 ulp to the final rounding's 0.5.
constexpr double kNearUlps = 1.0;
constexpr double kFarUlps = 1.5;

struct Worst {
  double ulps = 0;
  float at = 0;
  int64_t n = 0;
  void Add(float y) {
    const double e = UlpError(SoftcapTanh(y), y);
    if (e > ulps) ulps = e, at = y;
    ++n;
  }
};

TEST(SoftcapTanhTest, WithinBoundsOverTheRange) {
  Worst near, far;
  // Every 61st float from 2^-30 to 48 (past 9.1 every result is 1), and every float within
  // 2^-10 of the branch point.
  auto add = [&](float y) {
    (std::fabs(y) < kTanhNear ? near : far).Add(y);
    (std::fabs(y) < kTanhNear ? near : far).Add(-y);
  };
  for (uint32_t b = Bits(0x1p-30f); b < Bits(48.0f); b += 61) add(FromBits(b));
  for (uint32_t b = Bits(kTanhNear - 0x1p-10f); b <= Bits(kTanhNear + 0x1p-10f); ++b) {
    add(FromBits(b));
  }
  EXPECT_GT(near.n, 1000000);
  EXPECT_GT(far.n, 100000);
  EXPECT_LE(near.ulps, kNearUlps) << "polynomial, at y = " << near.at;
  EXPECT_LE(far.ulps, kFarUlps) << "exponential form, at y = " << far.at;
}

TEST(SoftcapTanhTest, OddMonotoneAndSaturating) {
  float prev = 0.0f;
  int64_t drops = 0;
  for (uint32_t b = 1; b < Bits(48.0f); b += 7) {
    const float y = FromBits(b), t = SoftcapTanh(y);
    ASSERT_EQ(Bits(SoftcapTanh(-y)), Bits(-t)) << y;
    if (t < prev) ++drops;
    ASSERT_LE(t, 1.0f) << y;
    prev = t;
  }
  EXPECT_EQ(drops, 0);
  // Across the branch point, float by float.
  prev = SoftcapTanh(kTanhNear - 0x1p-12f);
  for (uint32_t b = Bits(kTanhNear - 0x1p-12f); b <= Bits(kTanhNear + 0x1p-12f); ++b) {
    const float t = SoftcapTanh(FromBits(b));
    EXPECT_GE(t, prev) << FromBits(b);
    prev = t;
  }
  EXPECT_EQ(SoftcapTanh(9.5f), 1.0f);
  EXPECT_EQ(SoftcapTanh(1e30f), 1.0f);
  EXPECT_EQ(SoftcapTanh(INFINITY), 1.0f);
  EXPECT_EQ(SoftcapTanh(-INFINITY), -1.0f);
  EXPECT_TRUE(std::isnan(SoftcapTanh(NAN)));
  EXPECT_EQ(SoftcapTanh(0.0f), 0.0f);
  // Tiny arguments: tanh(y) rounds to y itself.
  EXPECT_EQ(SoftcapTanh(1e-20f), 1e-20f);
  EXPECT_EQ(SoftcapTanh(-3e-5f), -3e-5f);
}

}  // namespace
}  // namespace cuda
}  // namespace lossd
