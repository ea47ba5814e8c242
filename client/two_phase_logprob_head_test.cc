// SPDX-License-Identifier: Apache-2.0
// Tests TwoPhaseLogprob over a PooledClient of three real replicas (pool_test_fixture.h)
// against a hosted head on one of them: the kept forward and its backward go to the head's
// replica, the backward adds the micro-batch into the head's step once (the stepped W equals,
// byte for byte, an identical head's on the single-server reference that took the micro-batch
// as one one-phase call), and the helper counts it two-phase. A head that steps between the
// forward and the backward: the ticket is FAILED_PRECONDITION naming both versions, the
// helper's one-phase call meets the head's own version refusal and returns it (as
// docs/rl_clients.md says), nothing is added, and the micro-batch redone at the new version
// adds once.
#include <string>

#include "client/two_phase_logprob.h"
#include "testing/client/pool_test_fixture.h"

namespace lossd {
namespace client {
namespace {

using ::testing::HasSubstr;

constexpr float kTemperature = 0.8f;

class TwoPhaseHeadTest : public PoolTest {
 protected:
  static CreateHeadRequest NewHead(const std::string& name) {
    return PoolSgdHead(name, 71);
  }
  // Micro-batch `seed`'s one-phase call against `head` at `version`, less its gradients.
  static ComputeRequest Call(uint32_t seed, const std::string& head, uint64_t version,
                             uint64_t micro_batch) {
    ComputeRequest r = PoolMicroBatch(seed);
    r.kind = LossKind::kLogprob;
    r.options.temperature = kTemperature;
    r.head = head;
    r.head_version = version;
    r.rank = 0;
    r.micro_batch = micro_batch;
    r.want.entropy = true;
    r.want.dx = true;
    r.want.dw = false;
    return r;
  }
  // Micro-batch `seed` as one one-phase call through `client` (the pool or the reference).
  template <typename Client>
  static ComputeResult OnePhase(Client& client, uint32_t seed, const std::string& head,
                                uint64_t version, uint64_t micro_batch) {
    ComputeRequest r = Call(seed, head, version, micro_batch);
    const PoolLogprobGrads g = PoolLogprobGradientsOf(seed);
    r.dlogp = g.dlogp;
    r.dentropy = g.dentropy;
    absl::StatusOr<ComputeResult> res = client.Compute(r);
    EXPECT_TRUE(res.ok()) << res.status();
    return res.ok() ? *std::move(res) : ComputeResult{};
  }
  // Steps `head` at `version` on the pool and on the reference twin, and expects the same
  // step (one contribution) and the same W and bias after it, byte for byte.
  void StepBothAndCompare(const std::string& head, uint64_t version) {
    StepRequest s;
    s.head = head;
    s.version = version;
    s.rank = 0;
    s.world_size = 1;
    absl::StatusOr<StepResult> stepped = pool_->Step(s);
    ASSERT_TRUE(stepped.ok()) << stepped.status();
    absl::StatusOr<StepResult> twin = reference_->Step(s);
    ASSERT_TRUE(twin.ok()) << twin.status();
    EXPECT_TRUE(stepped->applied);
    EXPECT_EQ(stepped->version, version + 1);
    EXPECT_EQ(stepped->contributions, 1u);
    EXPECT_EQ(twin->contributions, 1u);
    EXPECT_EQ(stepped->tokens, twin->tokens);
    EXPECT_GT(stepped->grad_norm, 0.0);
    EXPECT_EQ(stepped->grad_norm, twin->grad_norm);
    absl::StatusOr<HeadExport> got = pool_->ExportHead(head);
    ASSERT_TRUE(got.ok()) << got.status();
    absl::StatusOr<HeadExport> want = reference_->ExportHead(head);
    ASSERT_TRUE(want.ok()) << want.status();
    EXPECT_EQ(got->spec.version, version + 1);
    for (HeadTensor t : {HeadTensor::kMasterW, HeadTensor::kMasterBias}) {
      ASSERT_EQ(got->tensors.count(t), 1u) << static_cast<int>(t);
      ASSERT_EQ(want->tensors.count(t), 1u) << static_cast<int>(t);
      EXPECT_EQ(PoolMismatch(&got->tensors.at(t), &want->tensors.at(t)), "")
          << static_cast<int>(t);
    }
    const HostTensor start = NewHead(head).w;  // and W moved: the step was not empty
    EXPECT_NE(PoolMismatch(&got->tensors.at(HeadTensor::kMasterW), &start), "");
  }
  static void ExpectCounts(const TwoPhaseCounts& c, uint64_t tickets, uint64_t two_phase,
                           uint64_t gone) {
    EXPECT_EQ(c.tickets, tickets);
    EXPECT_EQ(c.two_phase, two_phase);
    EXPECT_EQ(c.gone, gone);
    EXPECT_EQ(c.not_kept, 0u);
    EXPECT_EQ(c.one_phase, 0u);  // never sent X again (or never succeeded doing so)
  }
};

TEST_F(TwoPhaseHeadTest, TheHelpersBackwardAddsTheMicroBatchOnceOnTheHeadsReplica) {
  const std::string name = HeadAwayFromRank0();
  const std::string on = Order(HeadKey(name)).front();
  const int home = IndexOf(on);
  ASSERT_TRUE(pool_->CreateHead(NewHead(name)).ok());
  ASSERT_TRUE(reference_->CreateHead(NewHead(name)).ok());  // its identical twin
  TwoPhaseLogprob lp(pool_.get());

  const ComputeRequest call = Call(5, name, 0, 3);
  absl::StatusOr<LogprobForward> f = lp.Forward(call);
  ASSERT_TRUE(f.ok()) << f.status();
  ASSERT_FALSE(f->ticket().empty());  // kept, not a fallback
  EXPECT_EQ(pool_->ReplicaOfTicket(f->ticket()), on);
  EXPECT_EQ(EngineOf(home).tickets().count(), 1u);
  EXPECT_NE(f->result().Find(OutputTensor::kLogp), nullptr);
  EXPECT_EQ(f->result().Find(OutputTensor::kDx), nullptr);

  const PoolLogprobGrads g = PoolLogprobGradientsOf(5);
  absl::StatusOr<ComputeResult> b = lp.Backward(*f, g.View());
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(EngineOf(home).tickets().count(), 0u);  // consumed by the backward
  ExpectCounts(lp.counts(), /*tickets=*/1, /*two_phase=*/1, /*gone=*/0);
  EXPECT_TRUE(lp.last_fallback().ok()) << lp.last_fallback();

  // The twin takes the micro-batch as one one-phase call: the same dX, the same step.
  const ComputeResult o = OnePhase(*reference_, 5, name, 0, 3);
  ASSERT_NE(b->Find(OutputTensor::kDx), nullptr);
  EXPECT_EQ(PoolMismatch(b->Find(OutputTensor::kDx), o.Find(OutputTensor::kDx)), "");
  StepBothAndCompare(name, 0);
}

TEST_F(TwoPhaseHeadTest, AHeadSteppedBetweenForwardAndBackwardIsRefusedAndAddsNothing) {
  const std::string name = HeadAwayFromRank0();
  const int home = IndexOf(Order(HeadKey(name)).front());
  ASSERT_TRUE(pool_->CreateHead(NewHead(name)).ok());
  ASSERT_TRUE(reference_->CreateHead(NewHead(name)).ok());
  TwoPhaseLogprob lp(pool_.get());

  // On the wire first: a ticket of version 0, the head steps, its backward is refused by the
  // server naming both versions.
  ComputeRequest raw = Call(6, name, 0, 0);
  raw.want.dx = false;
  raw.keep_ms = 60000;
  absl::StatusOr<ComputeResult> kept = pool_->Compute(raw);
  ASSERT_TRUE(kept.ok()) << kept.status();
  ASSERT_FALSE(kept->ticket.empty());
  // And through the helper: a forward of micro-batch 5 at version 0, kept (the helper views
  // the call's tensors: it outlives the forward).
  const ComputeRequest call = Call(5, name, 0, 3);
  absl::StatusOr<LogprobForward> f = lp.Forward(call);
  ASSERT_TRUE(f.ok()) << f.status();
  ASSERT_FALSE(f->ticket().empty());
  EXPECT_EQ(EngineOf(home).tickets().count(), 2u);

  // Step 0 takes another micro-batch (7), on both heads.
  OnePhase(*pool_, 7, name, 0, 1);
  OnePhase(*reference_, 7, name, 0, 1);
  StepBothAndCompare(name, 0);

  const PoolLogprobGrads g = PoolLogprobGradientsOf(5);
  ComputeRequest raw_back;
  raw_back.kind = LossKind::kLogprob;
  raw_back.ticket = kept->ticket;
  raw_back.rank = 0;
  raw_back.micro_batch = 2;
  raw_back.dlogp = g.dlogp;
  raw_back.want.dx = true;
  absl::StatusOr<ComputeResult> refused = pool_->Compute(raw_back);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
  EXPECT_THAT(std::string(refused.status().message()),
              HasSubstr(absl::StrCat("ticket '", kept->ticket, "' was computed against head '",
                                     name, "' at version 0, and the head is at version 1")));

  // The helper meets the same refusal by ticket (counted gone, its last fallback), sends the
  // one-phase call at the forward's version 0, and returns the head's refusal of that call.
  const std::string ticket = f->ticket();
  absl::StatusOr<ComputeResult> b = lp.Backward(*f, g.View());
  EXPECT_EQ(b.status().code(), absl::StatusCode::kFailedPrecondition) << b.status();
  EXPECT_THAT(std::string(b.status().message()),
              HasSubstr(absl::StrCat("head '", name, "' is at version 1, and this Compute "
                                     "names version 0")));
  EXPECT_EQ(f->ticket(), "");
  ExpectCounts(lp.counts(), /*tickets=*/1, /*two_phase=*/0, /*gone=*/1);
  EXPECT_EQ(lp.last_fallback().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(lp.last_fallback().message()),
              HasSubstr(absl::StrCat("ticket '", ticket, "' was computed against head '", name,
                                     "' at version 0, and the head is at version 1")));

  // Redone at version 1 through the helper, the micro-batch adds once: step 1 equals the
  // twin's, which took it once as a one-phase call (a refused backward that had added
  // anything would show in the count, the norm and W).
  const ComputeRequest redo = Call(5, name, 1, 3);
  absl::StatusOr<LogprobForward> again = lp.Forward(redo);
  ASSERT_TRUE(again.ok()) << again.status();
  ASSERT_FALSE(again->ticket().empty());
  absl::StatusOr<ComputeResult> redone = lp.Backward(*again, g.View());
  ASSERT_TRUE(redone.ok()) << redone.status();
  ExpectCounts(lp.counts(), /*tickets=*/2, /*two_phase=*/1, /*gone=*/1);
  const ComputeResult o = OnePhase(*reference_, 5, name, 1, 3);
  EXPECT_EQ(PoolMismatch(redone->Find(OutputTensor::kDx), o.Find(OutputTensor::kDx)), "");
  StepBothAndCompare(name, 1);
}

}  // namespace
}  // namespace client
}  // namespace lossd
