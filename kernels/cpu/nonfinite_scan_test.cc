// SPDX-License-Identifier: Apache-2.0
// Tests AnyNonFinite: random finite values (the largest finite ones included) pass in every
// float dtype; one NaN, +Inf or -Inf at the first, a middle or the last element is found, and
// only inside the range asked about.
#include "kernels/cpu/nonfinite_scan.h"

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "core/dtype.h"

namespace lossd {
namespace {

class NonFiniteScanTest : public ::testing::TestWithParam<DType> {};

TEST_P(NonFiniteScanTest, FindsEveryKindAtEveryPosition) {
  const DType t = GetParam();
  constexpr int64_t kN = 1001;  // odd: no vector width divides it
  std::mt19937 gen(11);
  std::uniform_real_distribution<float> u(-1000.0f, 1000.0f);
  std::vector<uint8_t> buf(kN * DTypeSize(t));
  for (int64_t i = 0; i < kN; ++i) StoreFromFloat(buf.data(), t, i, u(gen));
  // The largest finite value of the dtype: all exponent bits but one set.
  const float big = t == DType::kF16 ? 65504.0f
                    : t == DType::kBF16 ? Bf16ToFloat(0x7F7F)
                                        : std::numeric_limits<float>::max();
  StoreFromFloat(buf.data(), t, 7, big);
  StoreFromFloat(buf.data(), t, 8, -big);
  ASSERT_TRUE(std::isfinite(LoadAsFloat(buf.data(), t, 7)));
  EXPECT_FALSE(AnyNonFinite(buf.data(), t, 0, kN));

  const float bad[] = {std::numeric_limits<float>::quiet_NaN(),
                       std::numeric_limits<float>::infinity(),
                       -std::numeric_limits<float>::infinity()};
  for (float b : bad) {
    for (int64_t at : {int64_t{0}, int64_t{500}, kN - 1}) {
      std::vector<uint8_t> copy = buf;
      StoreFromFloat(copy.data(), t, at, b);
      EXPECT_TRUE(AnyNonFinite(copy.data(), t, 0, kN)) << b << " at " << at;
      // Outside the range scanned: not seen.
      if (at > 0) {
        EXPECT_FALSE(AnyNonFinite(copy.data(), t, 0, at)) << b << " at " << at;
      }
      if (at < kN - 1) {
        EXPECT_FALSE(AnyNonFinite(copy.data(), t, at + 1, kN - at - 1)) << b << " at " << at;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(FloatDTypes, NonFiniteScanTest,
                         ::testing::Values(DType::kBF16, DType::kF16, DType::kF32));

TEST(NonFiniteScan, OtherDTypesAndEmptyRangesPass) {
  const int64_t ints[2] = {-1, 0x7FF0000000000000};
  EXPECT_FALSE(AnyNonFinite(ints, DType::kI64, 0, 2));
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_FALSE(AnyNonFinite(&inf, DType::kF32, 0, 0));
}

}  // namespace
}  // namespace lossd
