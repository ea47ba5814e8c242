// SPDX-License-Identifier: Apache-2.0
// optimizer_math's host build: its bf16 cast (the one the CUDA kernel writes the compute copy
// with) equals core/dtype.h's FloatToBf16 on a sweep of bit patterns that covers every
// exponent, NaNs and infinities, and the rounding halfway cases; and the NaN-propagating max.
#include "kernels/optimizer_math.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "core/dtype.h"
#include "gtest/gtest.h"

namespace lossd {
namespace optimizer_math {
namespace {

float FromBits(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

TEST(OptimizerMathTest, Bf16BitsEqualsFloatToBf16) {
  int64_t bad = 0, checked = 0;
  // Every 251st pattern (an odd stride that walks every low-bit residue), plus each pattern
  // whose low 16 bits sit at or beside the halfway point 0x8000.
  for (uint64_t b = 0; b <= 0xFFFFFFFFu; b += 251) {
    const uint32_t bits = static_cast<uint32_t>(b);
    for (const uint32_t x : {bits, (bits & 0xFFFF0000u) | 0x8000u, (bits & 0xFFFF0000u) | 0x7FFFu,
                             (bits & 0xFFFF0000u) | 0x8001u}) {
      bad += Bf16Bits(x) != FloatToBf16(FromBits(x));
      ++checked;
    }
  }
  EXPECT_EQ(bad, 0) << " of " << checked;
  EXPECT_GT(checked, 60000000);
}

TEST(OptimizerMathTest, MaxPropagatesNanFromEitherSide) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  EXPECT_TRUE(std::isnan(MaxPropagatingNan(nan, 1.0f)));
  EXPECT_TRUE(std::isnan(MaxPropagatingNan(1.0f, nan)));
  EXPECT_EQ(MaxPropagatingNan(2.0f, 1.0f), 2.0f);
  EXPECT_EQ(MaxPropagatingNan(1.0f, 2.0f), 2.0f);
}

TEST(OptimizerMathTest, ScalarsRoundOnceFromDouble) {
  OptimizerParams p;
  p.lr = 0.1;
  p.weight_decay = 0.01;
  p.beta1 = 0.9;
  p.beta2 = 0.999;
  p.step = 2;
  const Scalars s = ScalarsOf(p);
  EXPECT_EQ(s.decay, static_cast<float>(1 - 0.1 * 0.01));
  EXPECT_EQ(s.lerp_weight, static_cast<float>(1 - 0.9));
  EXPECT_EQ(s.one_minus_beta2, static_cast<float>(1 - 0.999));
  EXPECT_EQ(s.bc2_sqrt, static_cast<float>(std::sqrt(1 - 0.999 * 0.999)));
  EXPECT_EQ(s.neg_step_size, static_cast<float>(-0.1 / (1 - 0.9 * 0.9)));
}

}  // namespace
}  // namespace optimizer_math
}  // namespace lossd
