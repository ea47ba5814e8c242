// SPDX-License-Identifier: Apache-2.0
// The two-phase row's arithmetic and text on the CPU (kinds_bench itself needs a GPU): the
// flops, each ratio from the times given, and the numbers in the printed line.
#include "bench/kernel/two_phase_row.h"

#include <string>

#include "gtest/gtest.h"

namespace lossd {
namespace bench {
namespace {

TEST(TwoPhaseRowTest, FlopsAreEightAgainstSixBtHv) {
  EXPECT_EQ(TwoPhaseFlop(8192, 4096, 128256), 8.0 * 8192 * 4096 * 128256);
  EXPECT_EQ(OnePhaseFlop(8192, 4096, 128256), 6.0 * 8192 * 4096 * 128256);
  // Past 2^31 in every factor's product: no integer overflow.
  EXPECT_GT(TwoPhaseFlop(16384, 8192, 262144), 2.8e14);
}

TEST(TwoPhaseRowTest, TheLineStatesEachRatioOfTheTimesGiven) {
  TwoPhaseTimes t;
  t.bt = 8192;
  t.h = 4096;
  t.v = 128256;
  t.floor_ms = 40.0;
  t.tuned_floor_ms = 32.0;
  t.one_phase_ms = 50.0;
  t.forward_ms = 15.0;
  t.two_phase_ms = 64.0;
  const std::string line = TwoPhaseLine(t);
  EXPECT_NE(line.find("at (8192, 4096, 128256)"), std::string::npos) << line;
  EXPECT_NE(line.find("forward 15.00 ms + backward 49.00 ms = 64.00 ms"), std::string::npos)
      << line;
  EXPECT_NE(line.find("1.600x the 6 BT H V floor (2.000x tuned)"), std::string::npos) << line;
  EXPECT_NE(line.find("1.280x the one-phase logprob with gradients (50.00 ms)"),
            std::string::npos)
      << line;
  EXPECT_NE(line.find("the flops predict 1.333x"), std::string::npos) << line;
  // 8 * 8192 * 4096 * 128256 flop in 64 ms: 537.9 TFLOP/s.
  EXPECT_NE(line.find("538 TFLOP/s"), std::string::npos) << line;
}

}  // namespace
}  // namespace bench
}  // namespace lossd
