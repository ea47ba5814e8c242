// SPDX-License-Identifier: Apache-2.0
#include "engine/fetch_lease.h"

#include <future>
#include <memory>
#include <optional>
#include <string>

#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "testing/engine_calls.h"

namespace lossd {
namespace {

EngineOptions WithBudget(uint64_t bytes) {
  EngineOptions o;
  o.memory_budget_bytes = bytes;
  o.instance = "here";
  return o;
}

class FetchLeaseTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ComputeOutcome o = AddRandomMicroBatch(engine_, "acc");
    ASSERT_TRUE(o.status.ok()) << o.status;
  }
  // A lease on all of "acc", admitted and with its snapshot taken.
  std::unique_ptr<FetchLease> Snapshot(bool reset) {
    FetchRequest r;
    r.accumulator = "acc";
    r.reset = reset;
    auto lease = FetchLease::Check(&engine_, r);
    EXPECT_TRUE(lease.ok()) << lease.status();
    std::optional<absl::Status> admitted;
    EXPECT_TRUE((*lease)->Admit([&](absl::Status s) { admitted = s; }).ok());
    EXPECT_TRUE(admitted.has_value() && admitted->ok());
    EXPECT_EQ(engine_.budget().in_use(), kAllBytes);
    EXPECT_TRUE((*lease)->TakeSnapshot().ok());
    return std::move(*lease);
  }
  // Settles `lease` and waits for its finish, which may run on the executor.
  absl::Status SettleAndWait(FetchLease& lease, absl::Status s, bool client_gone) {
    std::promise<absl::Status> finished;
    lease.Settle(s, client_gone, [&](absl::Status st) { finished.set_value(st); });
    return finished.get_future().get();
  }
  uint64_t MicroBatches() {
    auto g = engine_.FetchGradients("acc", false);
    EXPECT_TRUE(g.ok()) << g.status();
    return g.ok() ? g->micro_batches : 0;
  }

  static constexpr uint64_t kAllBytes = 5 * 3 * 4;  // dW (V=5, H=3) fp32, no bias
  Engine engine_{NewCpuBackend(1), WithBudget(1 << 20)};
};

TEST_F(FetchLeaseTest, CheckRefusesWhatTheEngineRefuses) {
  FetchRequest r;
  r.accumulator = "missing";
  EXPECT_EQ(FetchLease::Check(&engine_, r).status().code(), absl::StatusCode::kNotFound);
  r.accumulator = "acc";
  r.accumulator_instance = "elsewhere";
  auto s = FetchLease::Check(&engine_, r).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("accumulator_instance 'elsewhere' is not this server"),
            std::string::npos)
      << s;
}

TEST(FetchLeaseBudgetTest, ARangeLargerThanTheWholeBudgetIsRefusedAtCheck) {
  Engine engine(NewCpuBackend(1), WithBudget(32));
  ASSERT_TRUE(AddRandomMicroBatch(engine, "acc").status.ok());
  FetchRequest r;
  r.accumulator = "acc";
  auto s = FetchLease::Check(&engine, r).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(s.message().find("fetching bytes [0, 60) of accumulator 'acc' needs a host copy "
                             "of 60 bytes, more than the whole memory budget of 32 bytes"),
            std::string::npos)
      << s;
  r.end = 32;  // a range that fits
  EXPECT_TRUE(FetchLease::Check(&engine, r).ok());
}

TEST_F(FetchLeaseTest, ADeliveredResetFetchKeepsTheResetAndGivesTheMemoryBack) {
  auto lease = Snapshot(/*reset=*/true);
  EXPECT_EQ(lease->snapshot().micro_batches, 1u);
  ASSERT_EQ(lease->data()->size(), 1u);
  EXPECT_TRUE(SettleAndWait(*lease, absl::OkStatus(), false).ok());
  EXPECT_EQ(engine_.budget().in_use(), 0u);
  lease->Delivered(true);
  lease.reset();
  DrainExecutor(engine_);
  EXPECT_EQ(MicroBatches(), 0u);
}

TEST_F(FetchLeaseTest, AFailedResetFetchPutsTheSumBackAndSaysSo) {
  auto lease = Snapshot(/*reset=*/true);
  absl::Status s = SettleAndWait(*lease, absl::CancelledError("the client went away"), false);
  EXPECT_EQ(s.code(), absl::StatusCode::kCancelled);
  EXPECT_NE(s.message().find("the client went away; its reset was undone: accumulator 'acc' "
                             "holds its 1 micro-batches again"),
            std::string::npos)
      << s;
  EXPECT_EQ(engine_.budget().in_use(), 0u);
  EXPECT_EQ(MicroBatches(), 1u);
}

TEST_F(FetchLeaseTest, AnOkResetTheClientNeverSawIsACancelAndIsUndone) {
  auto lease = Snapshot(/*reset=*/true);
  absl::Status s = SettleAndWait(*lease, absl::OkStatus(), /*client_gone=*/true);
  EXPECT_EQ(s.code(), absl::StatusCode::kCancelled);
  EXPECT_NE(s.message().find("the call was cancelled before its OK status went out; its "
                             "reset was undone"),
            std::string::npos)
      << s;
  EXPECT_EQ(MicroBatches(), 1u);
}

// Settled OK, but the OK never reached the client: undone on the executor, by
// Delivered(false) or by the destructor alike.
TEST_F(FetchLeaseTest, AnUndeliveredOkResetIsUndoneOnTheExecutor) {
  for (bool by_destructor : {false, true}) {
    auto lease = Snapshot(/*reset=*/true);
    ASSERT_TRUE(SettleAndWait(*lease, absl::OkStatus(), false).ok());
    if (!by_destructor) lease->Delivered(false);
    lease.reset();
    DrainExecutor(engine_);
    EXPECT_EQ(MicroBatches(), 1u) << by_destructor;
  }
}

TEST_F(FetchLeaseTest, APlainFetchChangesNothingWhateverItsEnd) {
  auto lease = Snapshot(/*reset=*/false);
  absl::Status s = SettleAndWait(*lease, absl::OkStatus(), /*client_gone=*/true);
  EXPECT_TRUE(s.ok()) << s;  // nothing was reset, so nothing to be lost
  EXPECT_EQ(lease->data(), nullptr);
  EXPECT_EQ(engine_.budget().in_use(), 0u);
  EXPECT_EQ(MicroBatches(), 1u);
}

TEST_F(FetchLeaseTest, AWithdrawnLeaseIsAnsweredCancelledAndHoldsNothing) {
  Admission holder(&engine_.budget());
  ASSERT_TRUE(holder.Request(1 << 20, "holder", [](absl::Status) {}).ok());
  FetchRequest r;
  r.accumulator = "acc";
  auto lease = FetchLease::Check(&engine_, r);
  ASSERT_TRUE(lease.ok());
  std::optional<absl::Status> admitted;
  ASSERT_TRUE((*lease)->Admit([&](absl::Status s) { admitted = s; }).ok());
  EXPECT_FALSE(admitted.has_value());
  (*lease)->Withdraw();
  ASSERT_TRUE(admitted.has_value());
  EXPECT_EQ(admitted->code(), absl::StatusCode::kCancelled);
  holder.Release();
  EXPECT_EQ(engine_.budget().in_use(), 0u);
}

}  // namespace
}  // namespace lossd
