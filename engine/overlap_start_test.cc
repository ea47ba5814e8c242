// SPDX-License-Identifier: Apache-2.0
#include "engine/overlap_start.h"

#include "gtest/gtest.h"

namespace lossd {
namespace {

TEST(OverlapStartTest, NeverBeforeEveryInputButXIsIn) {
  const OverlapProgress p{false, 8, 8};
  EXPECT_FALSE(OverlapMayStart(p, /*start_when_busy=*/true, /*executor_idle=*/true));
}

TEST(OverlapStartTest, EarlyOnlyOnAnIdleExecutorUnlessAskedToStartWhenBusy) {
  const OverlapProgress part_of_x{true, 3, 8};
  EXPECT_TRUE(OverlapMayStart(part_of_x, false, /*executor_idle=*/true));
  EXPECT_FALSE(OverlapMayStart(part_of_x, false, /*executor_idle=*/false));
  EXPECT_TRUE(OverlapMayStart(part_of_x, /*start_when_busy=*/true, false));
}

TEST(OverlapStartTest, AllOfXInStartsWhateverTheExecutorDoes) {
  EXPECT_TRUE(OverlapMayStart(OverlapProgress{true, 8, 8}, false, false));
  EXPECT_TRUE(OverlapMayStart(OverlapProgress{true, 0, 0}, false, false));  // BT = 0
}

}  // namespace
}  // namespace lossd
