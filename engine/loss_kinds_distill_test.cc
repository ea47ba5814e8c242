// SPDX-License-Identifier: Apache-2.0
// The distill kind's options beyond a teacher head's divergence through the engine (no gRPC):
// the hard-label term's weights (each behind its backend bit, UNIMPLEMENTED naming the field
// without it, announced as a feature with it), their refusals naming the field and value, and
// the labels the term needs (planned present, each in [0, V) when the data arrives). The
// backend is KindsBackend (testing/kinds_backend.h); the math is the backends' tests'.
#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "engine/features.h"
#include "gtest/gtest.h"
#include "testing/engine_calls.h"
#include "testing/kinds_backend.h"
#include "testing/test_util.h"

namespace lossd {
namespace {

constexpr int64_t kBt = 6, kH = 5, kV = 9, kHt = 7;
constexpr uint32_t kAllKinds = LossKindBit(LossKind::kCrossEntropy) |
                               LossKindBit(LossKind::kLogprob) |
                               LossKindBit(LossKind::kPolicy) | LossKindBit(LossKind::kDistill);

void ExpectStatus(const absl::Status& s, absl::StatusCode code, const std::string& message) {
  EXPECT_EQ(s.code(), code) << s;
  EXPECT_EQ(s.message(), message);
}

class DistillOptionsTest : public ::testing::Test {
 protected:
  DistillOptionsTest()
      : seen_(std::make_shared<KindsSeen>()),
        student_(RandomProblem::Make(ShapeSpec(kBt, kH, kV))),
        teacher_(RandomProblem::Make(ShapeSpec(kBt, kHt, kV))) {}

  ComputeSpec Spec() const {
    ComputeSpec s = ComputeSpecFor(student_);
    s.kind = LossKind::kDistill;
    SetInput(&s, InputSlot::kTeacherX, InputDesc(DType::kBF16, {kBt, kHt}));
    SetInput(&s, InputSlot::kTeacherW, InputDesc(DType::kBF16, {kV, kHt}));
    return s;
  }

  std::unique_ptr<Engine> MakeEngine(uint32_t loss_kinds) {
    return std::make_unique<Engine>(std::make_unique<KindsBackend>(loss_kinds, seen_),
                                    EngineOptions{});
  }

  ComputeOutcome Run(Engine& e, const ComputeSpec& spec) {
    return PlanAndRun(e, spec, [this](const ComputePlan& plan) {
      InputSources src{};
      src[static_cast<int>(InputSlot::kX)] = student_.x.data();
      src[static_cast<int>(InputSlot::kW)] = student_.w.data();
      src[static_cast<int>(InputSlot::kTargets)] = student_.targets.data();
      src[static_cast<int>(InputSlot::kTeacherX)] = teacher_.x.data();
      src[static_cast<int>(InputSlot::kTeacherW)] = teacher_.w.data();
      return InputBuffersFrom(plan, src);
    });
  }

  std::shared_ptr<KindsSeen> seen_;
  RandomProblem student_, teacher_;
};

TEST_F(DistillOptionsTest, WeightsNeedTheBackendsBitAndAreAnnounced) {
  ComputeSpec spec = Spec();
  spec.distill.weight_hard_loss = 0.5f;
  spec.distill.weight_soft_loss = 0.5f;
  std::unique_ptr<Engine> without = MakeEngine(kAllKinds);
  ExpectStatus(without->Plan(spec).status(), absl::StatusCode::kUnimplemented,
               "this server's backend 'kinds-fake' does not compute "
               "header.distill.weight_hard_loss / weight_soft_loss other than (0, 1) "
               "(ServerInfo.features lists distill_hard_loss where it does)");
  spec.distill.weight_hard_loss = 0.0f;  // the soft weight alone is an option too
  EXPECT_EQ(without->Plan(spec).status().code(), absl::StatusCode::kUnimplemented);
  spec.distill.weight_soft_loss = 1.0f;  // the defaults: the divergence alone
  EXPECT_TRUE(without->Plan(spec).ok()) << without->Plan(spec).status();
  const std::vector<std::string> f = ServerFeatures(kAllKinds);
  EXPECT_EQ(std::find(f.begin(), f.end(), "distill_hard_loss"), f.end());

  std::unique_ptr<Engine> with = MakeEngine(kAllKinds | kDistillWeightsBit);
  spec.distill.weight_hard_loss = 0.25f;
  spec.distill.weight_soft_loss = 0.75f;
  const ComputeOutcome r = Run(*with, spec);
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_EQ(seen_->problem.distill.weight_hard_loss, 0.25f);
  EXPECT_EQ(seen_->problem.distill.weight_soft_loss, 0.75f);
  const std::vector<std::string> g = ServerFeatures(kAllKinds | kDistillWeightsBit);
  EXPECT_NE(std::find(g.begin(), g.end(), "distill_hard_loss"), g.end());
}

TEST_F(DistillOptionsTest, WeightsAndTheirLabelsAreRefusedNamingTheField) {
  std::unique_ptr<Engine> e = MakeEngine(kAllKinds | kDistillWeightsBit);
  ComputeSpec spec = Spec();
  spec.distill.weight_hard_loss = -1.0f;
  ExpectStatus(e->Plan(spec).status(), absl::StatusCode::kInvalidArgument,
               "distill.weight_hard_loss must be finite and >= 0, got -1");
  spec.distill.weight_hard_loss = 0.5f;
  spec.distill.weight_soft_loss = INFINITY;
  ExpectStatus(e->Plan(spec).status(), absl::StatusCode::kInvalidArgument,
               "distill.weight_soft_loss must be finite and >= 0, got inf");
  spec.distill.weight_soft_loss = 0.5f;
  SetInput(&spec, InputSlot::kTargets, TensorDesc{});
  ExpectStatus(e->Plan(spec).status(), absl::StatusCode::kInvalidArgument,
               "header.targets is missing: distill.weight_hard_loss 0.5 needs the labels of "
               "its cross-entropy term");
  // Without the hard term the labels only mark ignored rows: any value passes. With it each
  // must be a class, refused when the data arrives.
  spec = Spec();
  student_.targets[2] = kV;
  EXPECT_TRUE(Run(*e, spec).status.ok());
  spec.distill.weight_hard_loss = 0.5f;
  ExpectStatus(Run(*e, spec).status, absl::StatusCode::kInvalidArgument,
               "targets[2] = 9 is outside [0, V=9) and is not ignore_index (-100)");
}

}  // namespace
}  // namespace lossd
