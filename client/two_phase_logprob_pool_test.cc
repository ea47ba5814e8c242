// SPDX-License-Identifier: Apache-2.0
// Tests TwoPhaseLogprob over a PooledClient of three real replicas (pool_test_fixture.h):
// the backward goes by ticket to the forward's replica and gives the single-server one-phase
// call's outputs byte for byte; where the pool cannot route it (the ticket's replica stopped;
// an accumulator placed on another replica) the one-phase call stands in, routed by the
// pool's own key (the weights moved; the accumulator's replica), with the same outputs.
#include <string>

#include "client/two_phase_logprob.h"
#include "testing/client/pool_test_fixture.h"

namespace lossd {
namespace client {
namespace {

using ::testing::HasSubstr;

class TwoPhasePoolTest : public PoolWeightsTest {
 protected:
  // The first accumulator name whose rendezvous home is not replica 0.
  std::string AccumulatorAwayFrom0() const {
    for (int n = 0;; ++n) {
      const std::string name = absl::StrCat("acc-", n);
      if (Order(AccumulatorKey(name)).front() != Endpoint(0)) return name;
    }
  }

  // Micro-batch `seed`'s one-phase call less its upstream gradients, against weights `name`.
  static ComputeRequest Call(uint32_t seed, const std::string& name) {
    ComputeRequest r = PoolMicroBatch(seed);
    r.kind = LossKind::kLogprob;
    r.options.temperature = 0.8f;
    r.weight_handle = name;
    r.want.entropy = true;
    r.want.dx = true;
    r.want.dw = true;
    return r;
  }
  // The one-phase call on the single-server reference (dw wanted as `call` wants it).
  ComputeResult Reference(uint32_t seed, const ComputeRequest& call) {
    ComputeRequest r = Call(seed, reference_handle_);
    r.want = call.want;
    const PoolLogprobGrads g = PoolLogprobGradientsOf(seed);
    r.dlogp = g.dlogp;
    r.dentropy = g.dentropy;
    absl::StatusOr<ComputeResult> res = reference_->Compute(r);
    EXPECT_TRUE(res.ok()) << res.status();
    return res.ok() ? *std::move(res) : ComputeResult{};
  }
  static void ExpectSame(const ComputeResult& got, const ComputeResult& want) {
    ASSERT_EQ(got.outputs.size(), want.outputs.size());
    for (const auto& [t, tensor] : want.outputs) {
      EXPECT_EQ(PoolMismatch(got.Find(t), &tensor), "") << OutputTensorName(t);
    }
  }
};

TEST_F(TwoPhasePoolTest, TheBackwardGoesByTicketToTheForwardsReplica) {
  TwoPhaseLogprob lp(pool_.get());
  for (int i = 0; i < kReplicas; ++i) {
    const ComputeRequest call = Call(10 + i, WeightsOn(*pool_, i));
    absl::StatusOr<LogprobForward> f = lp.Forward(call);
    ASSERT_TRUE(f.ok()) << f.status();
    ASSERT_FALSE(f->ticket().empty());
    EXPECT_EQ(pool_->ReplicaOfTicket(f->ticket()), Endpoint(i));
    const std::map<std::string, uint64_t> before = pool_->counters().calls;
    const PoolLogprobGrads g = PoolLogprobGradientsOf(10 + i);
    absl::StatusOr<ComputeResult> b = lp.Backward(*f, g.View());
    ASSERT_TRUE(b.ok()) << b.status();
    std::map<std::string, uint64_t> want = before;
    ++want[Endpoint(i)];
    EXPECT_EQ(pool_->counters().calls, want);
    EXPECT_EQ(EngineOf(i).tickets().count(), 0u);
    ExpectSame(*b, Reference(10 + i, call));
  }
  const TwoPhaseCounts c = lp.counts();
  EXPECT_EQ(c.tickets, 3u);
  EXPECT_EQ(c.two_phase, 3u);
  EXPECT_EQ(c.gone + c.not_kept + c.one_phase, 0u);
}

TEST_F(TwoPhasePoolTest, AStoppedReplicasTicketFallsBackWhereTheWeightsMoved) {
  std::vector<std::string> logged;
  TwoPhaseOptions o;
  o.log = [&logged](const std::string& line) { logged.push_back(line); };
  TwoPhaseLogprob lp(pool_.get(), o);
  const ComputeRequest call = Call(20, WeightsOn(*pool_, 1));
  absl::StatusOr<LogprobForward> f = lp.Forward(call);
  ASSERT_TRUE(f.ok()) << f.status();
  Stop(1);
  const PoolLogprobGrads g = PoolLogprobGradientsOf(20);
  absl::StatusOr<ComputeResult> b = lp.Backward(*f, g.View());
  ASSERT_TRUE(b.ok()) << b.status();
  ExpectSame(*b, Reference(20, call));
  EXPECT_EQ(lp.last_fallback().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(lp.last_fallback().message(), HasSubstr("which is unreachable"));
  const TwoPhaseCounts c = lp.counts();
  EXPECT_EQ(c.tickets, 1u);
  EXPECT_EQ(c.gone, 1u);
  EXPECT_EQ(c.one_phase, 1u);
  EXPECT_EQ(c.two_phase, 0u);
  ASSERT_EQ(logged.size(), 1u);
  EXPECT_THAT(logged[0], HasSubstr("a ticket was gone at backward"));
}

TEST_F(TwoPhasePoolTest, AnAccumulatorOnAnotherReplicaTakesTheOnePhaseCall) {
  TwoPhaseLogprob lp(pool_.get());
  const std::string acc = AccumulatorAwayFrom0();
  const std::string w0 = WeightsOn(*pool_, 0);
  // The accumulator begins at its own home with a first micro-batch.
  ComputeRequest first = Call(30, w0);
  const PoolLogprobGrads g0 = PoolLogprobGradientsOf(30);
  first.dlogp = g0.dlogp;
  first.accumulator = acc;
  first.want.dw = false;
  ASSERT_TRUE(pool_->Compute(first).ok());

  ComputeRequest call = Call(31, w0);  // its ticket is taken on replica 0
  call.accumulator = acc;
  call.want.dw = false;
  absl::StatusOr<LogprobForward> f = lp.Forward(call);
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(pool_->ReplicaOfTicket(f->ticket()), Endpoint(0));
  const PoolLogprobGrads g = PoolLogprobGradientsOf(31);
  absl::StatusOr<ComputeResult> b = lp.Backward(*f, g.View());
  ASSERT_TRUE(b.ok()) << b.status();
  ExpectSame(*b, Reference(31, call));
  EXPECT_EQ(lp.last_fallback().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(lp.last_fallback().message(), HasSubstr("a backward cannot add there"));
  absl::StatusOr<FetchGradientsResult> sum = pool_->FetchGradients(acc, true);
  ASSERT_TRUE(sum.ok()) << sum.status();
  EXPECT_EQ(sum->micro_batches, 2u);  // the first, and the one-phase call: added once
  EXPECT_EQ(lp.counts().gone, 1u);
  EXPECT_EQ(lp.counts().one_phase, 1u);
}

}  // namespace
}  // namespace client
}  // namespace lossd
