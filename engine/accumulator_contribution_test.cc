// SPDX-License-Identifier: Apache-2.0
#include "engine/accumulator_contribution.h"

#include <memory>
#include <string>

#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "testing/engine_calls.h"

namespace lossd {
namespace {

class AccumulatorContributionTest : public ::testing::Test {
 protected:
  // A contribution holding one micro-batch added into accumulator "acc".
  std::unique_ptr<AccumulatorContribution> Contribute() {
    ComputeOutcome o = AddRandomMicroBatch(engine_, "acc");
    EXPECT_TRUE(o.status.ok()) << o.status;
    EXPECT_NE(o.added_to, nullptr);
    auto c = std::make_unique<AccumulatorContribution>(&engine_);
    c->Added(o.added_to, o.added_resets);
    return c;
  }
  // The accumulator's state as a fetch sees it: OK, or FAILED_PRECONDITION once partial.
  absl::StatusCode FetchCode() { return engine_.FetchGradients("acc", false).status().code(); }

  Engine engine_{NewCpuBackend(1), EngineOptions{}};
};

TEST_F(AccumulatorContributionTest, ADeliveredOkLeavesTheSumTrusted) {
  auto c = Contribute();
  EXPECT_TRUE(c->Settle(absl::OkStatus(), /*client_gone=*/false).ok());
  c->Delivered(true);
  c.reset();
  DrainExecutor(engine_);
  EXPECT_EQ(FetchCode(), absl::StatusCode::kOk);
}

TEST_F(AccumulatorContributionTest, AFailureAfterAddingMarksTheSumPartialAndSaysSo) {
  auto c = Contribute();
  absl::Status s = c->Settle(absl::UnavailableError("the client went away"), false);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(s.message().find("the client went away; its micro-batch had already been added "
                             "into accumulator 'acc'"),
            std::string::npos)
      << s;
  EXPECT_EQ(FetchCode(), absl::StatusCode::kFailedPrecondition);  // at once, not later
}

TEST_F(AccumulatorContributionTest, AnOkTheClientNeverSawIsACancel) {
  auto c = Contribute();
  absl::Status s = c->Settle(absl::OkStatus(), /*client_gone=*/true);
  EXPECT_EQ(s.code(), absl::StatusCode::kCancelled);
  EXPECT_NE(s.message().find("the call was cancelled before its OK status went out"),
            std::string::npos)
      << s;
  EXPECT_EQ(FetchCode(), absl::StatusCode::kFailedPrecondition);
}

// Settled OK, but the call ended without the OK reaching the client: marked partial on the
// executor, by Delivered(false) or by the destructor alike.
TEST_F(AccumulatorContributionTest, AnUndeliveredOkMarksTheSumPartialOnTheExecutor) {
  for (bool by_destructor : {false, true}) {
    auto c = Contribute();
    ASSERT_TRUE(c->Settle(absl::OkStatus(), false).ok());
    EXPECT_EQ(FetchCode(), absl::StatusCode::kOk);  // held, not yet decided
    if (!by_destructor) c->Delivered(false);
    c.reset();
    DrainExecutor(engine_);
    EXPECT_EQ(FetchCode(), absl::StatusCode::kFailedPrecondition) << by_destructor;
    ASSERT_TRUE(engine_.DropAccumulator("acc").ok());
  }
}

TEST_F(AccumulatorContributionTest, NothingAddedLeavesTheStatusAsItIs) {
  AccumulatorContribution c(&engine_);
  c.Added(nullptr, 0);
  EXPECT_TRUE(c.Settle(absl::OkStatus(), /*client_gone=*/true).ok());
  absl::Status s = c.Settle(absl::InvalidArgumentError("bad part"), false);
  EXPECT_EQ(s, absl::InvalidArgumentError("bad part"));
}

}  // namespace
}  // namespace lossd
