// SPDX-License-Identifier: Apache-2.0
// A loss that overflows fp32 from finite inputs, through the engine on the CPU backend: the
// refusal names what overflowed (a policy's KL term or importance ratio at its row, with its
// inputs; else the logits), and ComputeSpec::allow_nonfinite_loss answers it instead, with
// inf and the non-finite dX flagged, except into an accumulator.
#include <cmath>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "testing/engine_calls.h"
#include "testing/test_util.h"

namespace lossd {
namespace {

constexpr int64_t kBt = 6, kH = 5, kV = 9;
constexpr int kRow = 3;  // the row whose inputs overflow

class OverflowTest : public ::testing::Test {
 protected:
  OverflowTest()
      : e_(NewCpuBackend(1), EngineOptions{}),
        rp_(RandomProblem::Make(ShapeSpec(kBt, kH, kV, DType::kF32))),
        advantages_(RandomRows(kBt, 21)), old_(kBt, -1.0f), ref_(kBt, -1.0f) {}

  // A policy call over rp_ with the given per-row inputs (old_logp and ref_logp sent).
  ComputeSpec PolicySpec(float beta) const {
    ComputeSpec s = ComputeSpecFor(rp_);
    s.kind = LossKind::kPolicy;
    s.policy.beta = beta;
    s.policy.loss_type = PolicyLossType::kGrpo;
    for (InputSlot slot : {InputSlot::kAdvantages, InputSlot::kOldLogp, InputSlot::kRefLogp}) {
      SetInput(&s, slot, InputDesc(DType::kF32, {kBt}));
    }
    return s;
  }

  ComputeOutcome Run(const ComputeSpec& spec) {
    return PlanAndRun(e_, spec, [this](const ComputePlan& plan) {
      InputSources src = InputSourcesOf(rp_.problem());
      src[static_cast<int>(InputSlot::kAdvantages)] = advantages_.data();
      src[static_cast<int>(InputSlot::kOldLogp)] = old_.data();
      src[static_cast<int>(InputSlot::kRefLogp)] = ref_.data();
      return InputBuffersFrom(plan, src);
    });
  }

  Engine e_;
  RandomProblem rp_;
  std::vector<float> advantages_, old_, ref_;
};

// ref_logp - logp far above log(FLT_MAX) = 88.72 at one row (Liger's fp32 KL term is inf).
TEST_F(OverflowTest, TheKlTermThatOverflowsIsNamedWithItsRowAndInputs) {
  ref_[kRow] = 300.0f;
  ComputeOutcome r = Run(PolicySpec(0.04f));
  EXPECT_EQ(r.status.code(), absl::StatusCode::kInvalidArgument) << r.status;
  const std::string m(r.status.message());
  EXPECT_NE(m.find("the loss is not finite (kind policy): the KL term exp(ref_logp - logp) "
                   "overflows fp32 at row 3: ref_logp[3] = 300, logp = "),
            std::string::npos) << m;
  EXPECT_NE(m.find("check ref_logp"), std::string::npos) << m;
  EXPECT_EQ(m.find("the logits X W^T"), std::string::npos) << m;
  EXPECT_NE(m.find("header.allow_nonfinite_loss"), std::string::npos) << m;
}

TEST_F(OverflowTest, TheImportanceRatioThatOverflowsIsNamed) {
  old_[kRow] = -300.0f;
  advantages_[kRow] = -1.0f;  // r A unclipped below: the min takes it
  ComputeOutcome r = Run(PolicySpec(0.0f));
  EXPECT_EQ(r.status.code(), absl::StatusCode::kInvalidArgument) << r.status;
  EXPECT_NE(r.status.message().find("the importance ratio exp(logp - old_logp) overflows fp32 "
                                    "at row 3: old_logp[3] = -300, logp = "),
            std::string::npos) << r.status;
}

TEST_F(OverflowTest, AllowNonfiniteLossAnswersInfAndFlagsDx) {
  ref_[kRow] = 300.0f;
  ComputeSpec spec = PolicySpec(0.04f);
  spec.allow_nonfinite_loss = true;
  ComputeOutcome r = Run(spec);
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_TRUE(std::isinf(r.loss)) << r.loss;
  EXPECT_NE(r.stats.nonfinite & kNonFiniteDx, 0u);
  // The same call with finite inputs is answered as before, flag or not.
  ref_[kRow] = -1.0f;
  ComputeOutcome fine = Run(spec);
  ASSERT_TRUE(fine.status.ok()) << fine.status;
  EXPECT_TRUE(std::isfinite(fine.loss));
  EXPECT_EQ(fine.stats.nonfinite, 0u);
}

TEST_F(OverflowTest, AnAccumulatorKeepsItsRefusal) {
  ref_[kRow] = 300.0f;
  ComputeSpec spec = PolicySpec(0.04f);
  spec.allow_nonfinite_loss = true;
  spec.accumulator = "acc";
  ComputeOutcome r = Run(spec);
  EXPECT_EQ(r.status.code(), absl::StatusCode::kInvalidArgument) << r.status;
  EXPECT_NE(r.status.message().find("the KL term exp(ref_logp - logp) overflows fp32 at row 3"),
            std::string::npos) << r.status;
  EXPECT_NE(r.status.message().find("accumulator 'acc' received non-finite values"),
            std::string::npos) << r.status;
}

}  // namespace
}  // namespace lossd
