// SPDX-License-Identifier: Apache-2.0
// Tests TwoPhaseLogprob against the fake service (fake_loss_service.h), for servers the real
// one is not: one that does not list "logprob_two_phase" (no ticket is asked for; the
// backward sends X), and one that lists it but answers a kept forward without a ticket (its
// reply serves as the forward's, nothing is sent twice).
#include "client/two_phase_logprob.h"

#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "testing/client/lossd_client_fixture.h"

namespace lossd {
namespace client {
namespace {

using ::testing::HasSubstr;

class TwoPhaseFakeTest : public LossClientTest {
 protected:
  ComputeRequest Call() {
    ComputeRequest r = SmallRequest();
    r.kind = LossKind::kLogprob;
    r.want.entropy = true;
    r.want.dx = true;
    r.want.dw = false;
    return r;
  }
  v1::ComputeHeader LastHeader() {
    absl::MutexLock lock(&fake_.mu);
    return fake_.last_header;
  }
  int ServerInfoCalls() {
    absl::MutexLock lock(&fake_.mu);
    return fake_.server_info_calls;
  }
};

TEST_F(TwoPhaseFakeTest, AServerWithoutTheFeatureGetsNoTicketAndTheBackwardSendsX) {
  std::unique_ptr<LossClient> client = Client(Options());
  std::vector<std::string> logged;
  TwoPhaseOptions o;
  o.log = [&logged](const std::string& line) { logged.push_back(line); };
  TwoPhaseLogprob lp(client.get(), o);
  const ComputeRequest call = Call();
  const HostTensor dlogp = RandomTensor(DType::kF32, {call.x.dim(0)}, 7);
  for (int i = 1; i <= 2; ++i) {
    absl::StatusOr<LogprobForward> f = lp.Forward(call);
    ASSERT_TRUE(f.ok()) << f.status();
    EXPECT_TRUE(f->ticket().empty());
    ASSERT_NE(f->result().Find(OutputTensor::kLogp), nullptr);
    v1::ComputeHeader h = LastHeader();
    EXPECT_EQ(h.keep_ms(), 0u);
    EXPECT_FALSE(h.outputs().dx());  // the forward asks for no gradient
    EXPECT_FALSE(h.has_dlogp());

    absl::StatusOr<ComputeResult> b =
        lp.Backward(*f, {HostTensor::View(DType::kF32, dlogp.shape(), dlogp.data()), {}});
    ASSERT_TRUE(b.ok()) << b.status();
    h = LastHeader();
    EXPECT_TRUE(h.ticket().empty());
    EXPECT_TRUE(h.has_x());  // one phase: X again, with dlogp
    EXPECT_TRUE(h.has_dlogp());
    EXPECT_TRUE(h.outputs().dx());
    ASSERT_NE(b->Find(OutputTensor::kDx), nullptr);
    EXPECT_TRUE(SameBytes(*b->Find(OutputTensor::kDx), call.x));  // the fake's echo of X
    const TwoPhaseCounts c = lp.counts();
    EXPECT_EQ(c.not_kept, static_cast<uint64_t>(i));
    EXPECT_EQ(c.one_phase, static_cast<uint64_t>(i));
    EXPECT_EQ(c.tickets + c.two_phase + c.gone, 0u);
  }
  EXPECT_EQ(ServerInfoCalls(), 1);  // the client remembers the answer
  EXPECT_EQ(lp.last_fallback().code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(lp.last_fallback().message(), HasSubstr("logprob_two_phase"));
  ASSERT_EQ(logged.size(), 1u);
  EXPECT_THAT(logged[0], HasSubstr("a forward was not kept"));
}

TEST_F(TwoPhaseFakeTest, AKeptForwardAnsweredWithoutATicketIsNotSentTwice) {
  {
    absl::MutexLock lock(&fake_.mu);
    fake_.features = {"logprob_two_phase"};
  }
  std::unique_ptr<LossClient> client = Client(Options());
  TwoPhaseLogprob lp(client.get());  // no log: the counts and last_fallback tell
  absl::StatusOr<LogprobForward> f = lp.Forward(Call());
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_TRUE(f->ticket().empty());
  EXPECT_EQ(LastHeader().keep_ms(), 60000u);  // the one forward sent asked to keep
  EXPECT_EQ(lp.counts().not_kept, 1u);
  EXPECT_EQ(lp.last_fallback().code(), absl::StatusCode::kInternal);
  EXPECT_THAT(lp.last_fallback().message(), HasSubstr("without a ticket"));
}

}  // namespace
}  // namespace client
}  // namespace lossd
