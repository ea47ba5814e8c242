// SPDX-License-Identifier: Apache-2.0
#include "service/overlap_sends.h"

#include "gtest/gtest.h"

namespace lossd {
namespace {

using Kind = OverlapSends::Step::Kind;

// dX (BT=4 rows of 8 bytes) first, then dW (20 bytes); parts of at most 16 bytes.
OverlapSends Sends() { return OverlapSends({32, 20}, /*dx_output=*/0, /*bt=*/4, 16); }

// Expects a part of output `output` at [offset, offset + bytes) and ends its write.
void ExpectPart(OverlapSends& s, int64_t dx_rows, size_t output, uint64_t offset,
                uint64_t bytes) {
  OverlapSends::Step step = s.Next(dx_rows);
  ASSERT_EQ(step.kind, Kind::kPart);
  EXPECT_EQ(step.output, output);
  EXPECT_EQ(step.offset, offset);
  EXPECT_EQ(step.bytes, bytes);
  EXPECT_EQ(s.Next(dx_rows).kind, Kind::kWait) << "one write at a time";
  s.WriteDone();
}

TEST(OverlapSendsTest, DxFollowsItsRowsThenTheRestThenTheFinalSummaryThenTheFinish) {
  OverlapSends s = Sends();
  s.WriteStarted();  // the preliminary summary
  s.SetHandlingRead(true);
  EXPECT_EQ(s.Next(0).kind, Kind::kWait);
  s.WriteDone();
  s.ComputeStarted();
  s.SetHandlingRead(false);
  EXPECT_EQ(s.Next(0).kind, Kind::kWait);  // no row of dX final yet
  ExpectPart(s, 1, 0, 0, 8);
  EXPECT_EQ(s.Next(1).kind, Kind::kWait);
  ExpectPart(s, 4, 0, 8, 16);  // capped at the part size
  ExpectPart(s, 4, 0, 24, 8);
  EXPECT_EQ(s.Next(4).kind, Kind::kWait) << "dW is not final before the compute ends";
  s.ComputeEnded(absl::OkStatus());
  ExpectPart(s, 4, 1, 0, 16);
  ExpectPart(s, 4, 1, 16, 4);
  EXPECT_EQ(s.Next(4).kind, Kind::kWait) << "the client has not closed its side";
  s.ReadsDone();
  EXPECT_EQ(s.Next(4).kind, Kind::kFinalSummary);
  EXPECT_EQ(s.Next(4).kind, Kind::kWait);  // its write is in flight
  s.WriteDone();
  OverlapSends::Step finish = s.Next(4);
  EXPECT_EQ(finish.kind, Kind::kFinish);
  EXPECT_TRUE(finish.status.ok());
  EXPECT_EQ(s.Next(4).kind, Kind::kWait) << "the finish comes once";
}

// Once the compute is done every row of dX is final, whether reported or not.
TEST(OverlapSendsTest, AFinishedComputeMakesEveryRowOfDxFinal) {
  OverlapSends s = Sends();
  s.ComputeStarted();
  s.ComputeEnded(absl::OkStatus());
  ExpectPart(s, 0, 0, 0, 16);
  ExpectPart(s, 0, 0, 16, 16);
  ExpectPart(s, 0, 1, 0, 16);
}

TEST(OverlapSendsTest, AFailureFinishesOnlyOnceNothingIsInFlightAndTheFirstWins) {
  OverlapSends s = Sends();
  s.ComputeStarted();
  s.SetHandlingRead(true);
  s.Fail(absl::InvalidArgumentError("a bad part"));
  EXPECT_EQ(s.Next(4).kind, Kind::kWait) << "the compute job still holds the call";
  s.ComputeEnded(absl::CancelledError("stopped at the next rows"));
  EXPECT_EQ(s.Next(4).kind, Kind::kWait) << "a read is still being handled";
  s.SetHandlingRead(false);
  OverlapSends::Step finish = s.Next(4);
  EXPECT_EQ(finish.kind, Kind::kFinish);
  EXPECT_EQ(finish.status, absl::InvalidArgumentError("a bad part"));
  EXPECT_EQ(s.Next(4).kind, Kind::kWait);
}

TEST(OverlapSendsTest, AWriteInFlightHoldsEvenAFailure) {
  OverlapSends s = Sends();
  ASSERT_EQ(s.Next(1).kind, Kind::kPart);
  s.Fail(absl::CancelledError("the client went away"));
  EXPECT_EQ(s.Next(1).kind, Kind::kWait);
  s.WriteDone();
  EXPECT_EQ(s.Next(1).kind, Kind::kFinish);
}

TEST(OverlapSendsTest, WithoutDxTheOutputsWaitForTheCompute) {
  OverlapSends s({12}, /*dx_output=*/-1, /*bt=*/4, 16);
  s.ComputeStarted();
  EXPECT_EQ(s.Next(4).kind, Kind::kWait);
  s.ComputeEnded(absl::OkStatus());
  ExpectPart(s, 4, 0, 0, 12);
  s.ReadsDone();
  EXPECT_EQ(s.Next(4).kind, Kind::kFinalSummary);
}

}  // namespace
}  // namespace lossd
