// SPDX-License-Identifier: Apache-2.0
// Tests the pooled client against the fake service (fake_loss_service.h), which can fail a
// Compute with any code while it still answers: a call's own error comes back unchanged
// (no probe counts it as a lost replica), a stateless Compute cut off (UNAVAILABLE) is sent
// once more to the same replica, and a Compute into an accumulator cut off while its replica
// answers is ABORTED (it may or may not have been added) until the accumulator is dropped;
// ServerInfo and List over a replica that is gone.
#include <string>

#include "client/pooled_client.h"
#include "client/rendezvous.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "testing/client/lossd_client_fixture.h"

namespace lossd {
namespace client {
namespace {

using ::testing::HasSubstr;

class PooledFakeTest : public LossClientTest {
 protected:
  std::unique_ptr<PooledClient> Pool() {
    PoolOptions o;
    o.targets = absl::StrCat("127.0.0.1:", port_);
    o.client.deadline = absl::Seconds(30);
    o.probe_deadline = absl::Seconds(30);
    o.log = [](const std::string&) {};
    auto p = PooledClient::Create(o);
    EXPECT_TRUE(p.ok()) << p.status();
    return p.ok() ? std::move(*p) : nullptr;
  }
  void Fail(grpc::StatusCode code) {
    fake_.error_code = code;
    fake_.error_message = "injected";
    fake_.mode = Mode::kError;
  }
  uint64_t Calls(PooledClient& p) {
    return p.counters().calls[absl::StrCat("127.0.0.1:", port_)];
  }
};

TEST_F(PooledFakeTest, ACallsOwnErrorComesBackUnchanged) {
  std::unique_ptr<PooledClient> pool = Pool();
  Fail(grpc::StatusCode::INVALID_ARGUMENT);
  absl::StatusOr<ComputeResult> got = pool->Compute(SmallRequest());
  EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument);
  // LossClient adds the call's request id.
  EXPECT_THAT(std::string(got.status().message()),
              ::testing::MatchesRegex("injected \\(request_id [0-9a-f]{16}\\)"));
  EXPECT_EQ(Calls(*pool), 1u);
  // An error the pool makes itself (weights it was never given) sends and probes nothing.
  ComputeRequest r = SmallRequest();
  r.w.reset();
  r.weight_handle = "never-put";
  r.accumulator = "rank0-step1";
  got = pool->Compute(r);
  EXPECT_EQ(got.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(Calls(*pool), 1u);
  EXPECT_EQ(pool->counters().steps_lost, 0u);
  absl::MutexLock lock(&fake_.mu);
  EXPECT_EQ(fake_.server_info_calls, 0);  // not probed: nothing says the replica is gone
}

TEST_F(PooledFakeTest, AStatelessComputeCutOffIsSentOnceMoreToItsReplica) {
  std::unique_ptr<PooledClient> pool = Pool();
  Fail(grpc::StatusCode::UNAVAILABLE);
  absl::StatusOr<ComputeResult> got = pool->Compute(SmallRequest());
  EXPECT_EQ(got.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(Calls(*pool), 2u);  // once more after its replica answered the probe
  EXPECT_EQ(pool->counters().moves, 0u);
  fake_.mode = Mode::kEcho;
  EXPECT_TRUE(pool->Compute(SmallRequest()).ok());
}

TEST_F(PooledFakeTest, AComputeIntoAnAccumulatorCutOffIsAStepToRedo) {
  std::unique_ptr<PooledClient> pool = Pool();
  ComputeRequest r = SmallRequest();
  r.accumulator = "rank0-step4";
  ASSERT_TRUE(pool->Compute(r).ok());
  Fail(grpc::StatusCode::UNAVAILABLE);
  absl::StatusOr<ComputeResult> got = pool->Compute(r);
  ASSERT_EQ(got.status().code(), absl::StatusCode::kAborted) << got.status();
  EXPECT_THAT(std::string(got.status().message()),
              HasSubstr("was cut off (UNAVAILABLE: injected (request_id "));
  EXPECT_THAT(std::string(got.status().message()),
              HasSubstr("Redo the step: DropAccumulator('rank0-step4')"));
  EXPECT_EQ(Calls(*pool), 2u);  // never sent again
  fake_.mode = Mode::kEcho;
  EXPECT_EQ(pool->Compute(r).status().code(), absl::StatusCode::kAborted);
  EXPECT_EQ(pool->FetchGradients("rank0-step4", true).status().code(),
            absl::StatusCode::kAborted);
  EXPECT_EQ(Calls(*pool), 2u);
  EXPECT_EQ(pool->counters().steps_lost, 1u);
  ASSERT_TRUE(pool->DropAccumulator("rank0-step4").ok());
  {
    absl::MutexLock lock(&fake_.mu);
    EXPECT_EQ(fake_.accumulators.count("rank0-step4"), 0u);  // the drop reached the replica
  }
  ASSERT_TRUE(pool->Compute(r).ok());
  absl::StatusOr<FetchGradientsResult> sum = pool->FetchGradients("rank0-step4", true);
  ASSERT_TRUE(sum.ok()) << sum.status();
  EXPECT_EQ(sum->micro_batches, 1u);
}

// ServerInfo goes to the rank's replica, on to the next while that one is unreachable;
// List asks every replica and says which did not answer.
TEST_F(PooledFakeTest, ServerInfoAndListOverAReplicaThatIsGone) {
  {
    absl::MutexLock lock(&fake_.mu);
    fake_.features = {"list_state"};
  }
  const std::string up = absl::StrCat("127.0.0.1:", port_), gone = "127.0.0.2:1";
  uint32_t rank = 0;  // a rank whose home is the replica that is gone
  while (RendezvousOrder(RankKey(rank), {up, gone}).front() != gone) ++rank;
  PoolOptions o;
  o.targets = absl::StrCat(up, ",", gone);
  o.rank = rank;
  o.probe_deadline = absl::Seconds(30);
  o.log = [](const std::string&) {};
  auto pool = PooledClient::Create(o);
  ASSERT_TRUE(pool.ok()) << pool.status();
  absl::StatusOr<ServerInfoResult> info = (*pool)->ServerInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->instance, "fake-instance");
  EXPECT_EQ((*pool)->counters().calls.at(gone), 1u);

  HostTensor w = RandomTensor(DType::kBF16, {7, 5}, 4);
  ASSERT_TRUE((*pool)->PutWeights("w", w, nullptr).ok());
  auto lists = (*pool)->List();
  ASSERT_EQ(lists.size(), 2u);
  ASSERT_TRUE(lists.at(up).ok()) << lists.at(up).status();
  ASSERT_EQ(lists.at(up)->size(), 1u);
  EXPECT_EQ(lists.at(up)->front().kind, StateEntry::Kind::kWeights);
  EXPECT_EQ(lists.at(gone).status().code(), absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace client
}  // namespace lossd
