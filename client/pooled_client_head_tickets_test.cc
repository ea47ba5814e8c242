// SPDX-License-Identifier: Apache-2.0
// Tests the pooled client's two-phase log-prob against a hosted head, with three real
// replicas (pool_test_fixture.h): the kept forward names the head and goes to its replica,
// which issues the ticket; the backward (ticket, rank and micro_batch only) goes there too,
// gives the one-phase call's dX and adds the micro-batch into the head's step exactly once:
// the step's norm and count and the stepped head equal, byte for byte, those of an identical
// head on the single-server reference that took the same micro-batch as one one-phase call.
// A second backward with the ticket is NOT_FOUND (from the pool, and from the replica itself)
// and adds nothing.
#include <map>
#include <string>

#include "testing/client/pool_test_fixture.h"

namespace lossd {
namespace client {
namespace {

using ::testing::HasSubstr;

constexpr float kTemperature = 0.8f;
constexpr uint32_t kSeed = 60;
constexpr uint64_t kMicroBatch = 3;

class PoolHeadTicketsTest : public PoolTest {
 protected:
  static CreateHeadRequest NewHead(const std::string& name) {
    return PoolSgdHead(name, 61);
  }
  // The micro-batch against `head` at version 0 (forward fields only).
  static ComputeRequest Batch(const std::string& head) {
    ComputeRequest r = PoolMicroBatch(kSeed);
    r.kind = LossKind::kLogprob;
    r.options.temperature = kTemperature;
    r.head = head;
    r.head_version = 0;
    r.want = WantedOutputs{};
    r.want.dx = r.want.dw = false;
    r.want.entropy = true;
    return r;
  }
  // The upstream gradients (random, never zeros) and what a head's Compute returns: dX.
  static void WithGradients(ComputeRequest* r) {
    r->dlogp = UniformTensor(DType::kF32, {kPoolBT}, 300 + kSeed, 1.0f);
    r->dentropy = UniformTensor(DType::kF32, {kPoolBT}, 400 + kSeed, 1.0f);
    r->want.dx = true;
    r->want.dw = false;
  }
  static ComputeRequest Backward(const std::string& ticket) {
    ComputeRequest r;
    r.kind = LossKind::kLogprob;
    r.ticket = ticket;
    r.rank = 0;
    r.micro_batch = kMicroBatch;
    WithGradients(&r);
    return r;
  }
  static uint64_t AllCalls(PooledClient& pool) {
    uint64_t n = 0;
    for (const auto& [endpoint, calls] : pool.counters().calls) n += calls;
    return n;
  }
  static StepRequest FullStep(const std::string& head) {
    StepRequest s;
    s.head = head;
    s.version = 0;
    s.rank = 0;
    s.world_size = 1;
    return s;
  }
};

TEST_F(PoolHeadTicketsTest, TheBackwardAddsIntoTheHeadOnItsReplicaExactlyOnce) {
  const std::string name = HeadAwayFromRank0();
  const std::string on = Order(HeadKey(name)).front();
  const int home = IndexOf(on);
  ASSERT_TRUE(pool_->CreateHead(NewHead(name)).ok());
  ASSERT_TRUE(reference_->CreateHead(NewHead(name)).ok());  // its identical twin

  // The kept forward goes to the head's replica, which issues the ticket.
  ComputeRequest forward = Batch(name);
  forward.keep_ms = 60000;
  std::map<std::string, uint64_t> want_calls = pool_->counters().calls;
  absl::StatusOr<ComputeResult> f = pool_->Compute(forward);
  ASSERT_TRUE(f.ok()) << f.status();
  ASSERT_FALSE(f->ticket.empty());
  EXPECT_GT(f->ticket_expires_unix_ms, absl::ToUnixMillis(absl::Now()));
  EXPECT_NE(f->Find(OutputTensor::kLogp), nullptr);
  EXPECT_EQ(f->Find(OutputTensor::kDx), nullptr);
  ++want_calls[on];
  EXPECT_EQ(pool_->counters().calls, want_calls);
  EXPECT_EQ(pool_->ReplicaOfTicket(f->ticket), on);
  EXPECT_EQ(EngineOf(home).tickets().count(), 1u);

  // Its backward goes there and nowhere else, and gives the one-phase call's dX.
  absl::StatusOr<ComputeResult> b = pool_->Compute(Backward(f->ticket));
  ASSERT_TRUE(b.ok()) << b.status();
  ++want_calls[on];
  EXPECT_EQ(pool_->counters().calls, want_calls);
  EXPECT_EQ(EngineOf(home).tickets().count(), 0u);  // consumed
  EXPECT_EQ(pool_->ReplicaOfTicket(f->ticket), "");
  ComputeRequest one = Batch(name);
  one.rank = 0;
  one.micro_batch = kMicroBatch;
  WithGradients(&one);
  absl::StatusOr<ComputeResult> o = reference_->Compute(one);
  ASSERT_TRUE(o.ok()) << o.status();
  ASSERT_NE(b->Find(OutputTensor::kDx), nullptr);
  EXPECT_EQ(PoolMismatch(b->Find(OutputTensor::kDx), o->Find(OutputTensor::kDx)), "");

  // A second backward with the ticket: NOT_FOUND from the pool (sent nowhere) and from the
  // replica itself; neither adds.
  absl::StatusOr<ComputeResult> again = pool_->Compute(Backward(f->ticket));
  EXPECT_EQ(again.status().code(), absl::StatusCode::kNotFound) << again.status();
  EXPECT_THAT(std::string(again.status().message()),
              HasSubstr(absl::StrCat("ticket '", f->ticket, "' was not taken through this pool")));
  EXPECT_EQ(pool_->counters().calls, want_calls);
  ClientOptions direct;
  direct.target = on;
  direct.deadline = absl::Seconds(120);
  absl::StatusOr<std::unique_ptr<LossClient>> replica = LossClient::Create(direct);
  ASSERT_TRUE(replica.ok()) << replica.status();
  again = (*replica)->Compute(Backward(f->ticket));
  EXPECT_EQ(again.status().code(), absl::StatusCode::kNotFound) << again.status();

  // The step holds the micro-batch once: the same norm, count and tokens as the twin's, and
  // the same W and bias after the update, byte for byte.
  absl::StatusOr<StepResult> stepped = pool_->Step(FullStep(name));
  ASSERT_TRUE(stepped.ok()) << stepped.status();
  absl::StatusOr<StepResult> twin = reference_->Step(FullStep(name));
  ASSERT_TRUE(twin.ok()) << twin.status();
  EXPECT_TRUE(stepped->applied);
  EXPECT_EQ(stepped->version, 1u);
  EXPECT_EQ(stepped->contributions, 1u);
  EXPECT_EQ(stepped->contributions, twin->contributions);
  EXPECT_EQ(stepped->tokens, twin->tokens);
  EXPECT_GT(stepped->grad_norm, 0.0);
  EXPECT_EQ(stepped->grad_norm, twin->grad_norm);
  absl::StatusOr<HeadExport> got = pool_->ExportHead(name);
  ASSERT_TRUE(got.ok()) << got.status();
  absl::StatusOr<HeadExport> want = reference_->ExportHead(name);
  ASSERT_TRUE(want.ok()) << want.status();
  EXPECT_EQ(got->spec.version, 1u);
  for (HeadTensor t : {HeadTensor::kMasterW, HeadTensor::kMasterBias}) {
    ASSERT_EQ(got->tensors.count(t), 1u) << static_cast<int>(t);
    ASSERT_EQ(want->tensors.count(t), 1u) << static_cast<int>(t);
    EXPECT_EQ(PoolMismatch(&got->tensors.at(t), &want->tensors.at(t)), "")
        << static_cast<int>(t);
  }
  // And W moved: the step was not empty on both sides.
  const HostTensor start = NewHead(name).w;
  EXPECT_NE(PoolMismatch(&got->tensors.at(HeadTensor::kMasterW), &start), "");
}

}  // namespace
}  // namespace client
}  // namespace lossd
