// SPDX-License-Identifier: Apache-2.0
// The distill kind's options beyond a teacher head's divergence through the engine (no gRPC):
// the hard-label term's weights and the top-k teacher (each behind its backend bit,
// UNIMPLEMENTED naming the field without it, announced as a feature with it), their refusals
// naming the field and value, the labels the hard term needs (planned present, each in [0, V)
// when the data arrives), the top-k tensors' shapes, dtypes and bytes, and their values
// refused when they arrive. The backend is KindsBackend (testing/kinds_backend.h); the math
// is the backends' tests'.
#include <algorithm>
#include <cmath>
#include <cstdint>
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

  // A top-k teacher of k ids per row instead of the head: distinct ids, log-probs of a
  // distribution (k of V equal shares, each below 1/k).
  ComputeSpec TopkSpec(int64_t k) {
    ComputeSpec s = Spec();
    SetInput(&s, InputSlot::kTeacherX, TensorDesc{});
    SetInput(&s, InputSlot::kTeacherW, TensorDesc{});
    SetInput(&s, InputSlot::kTeacherTopkIds, InputDesc(DType::kI32, {kBt, k}));
    SetInput(&s, InputSlot::kTeacherTopkLogp, InputDesc(DType::kF32, {kBt, k}));
    ids_.clear();
    logp_.clear();
    for (int64_t i = 0; i < kBt; ++i) {
      for (int64_t a = 0; a < k; ++a) {
        ids_.push_back(static_cast<int32_t>((i + 2 * a) % kV));
        logp_.push_back(-std::log(static_cast<float>(kV)) - 0.01f * a);
      }
    }
    return s;
  }

  ComputeOutcome Run(Engine& e, const ComputeSpec& spec) {
    return PlanAndRun(e, spec, [this](const ComputePlan& plan) {
      InputSources src{};
      src[static_cast<int>(InputSlot::kX)] = student_.x.data();
      src[static_cast<int>(InputSlot::kW)] = student_.w.data();
      src[static_cast<int>(InputSlot::kTargets)] = student_.targets.data();
      src[static_cast<int>(InputSlot::kTeacherX)] = teacher_.x.data();
      src[static_cast<int>(InputSlot::kTeacherW)] = teacher_.w.data();
      src[static_cast<int>(InputSlot::kTeacherTopkIds)] = ids_.data();
      src[static_cast<int>(InputSlot::kTeacherTopkLogp)] = logp_.data();
      return InputBuffersFrom(plan, src);
    });
  }

  std::shared_ptr<KindsSeen> seen_;
  RandomProblem student_, teacher_;
  std::vector<int32_t> ids_;
  std::vector<float> logp_;
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

TEST_F(DistillOptionsTest, TopkNeedsTheBackendsBitAndReachesIt) {
  ComputeSpec spec = TopkSpec(3);
  std::unique_ptr<Engine> without = MakeEngine(kAllKinds | kDistillWeightsBit);
  ExpectStatus(without->Plan(spec).status(), absl::StatusCode::kUnimplemented,
               "this server's backend 'kinds-fake' does not compute a top-k teacher "
               "(header.teacher_topk_ids, teacher_topk_logp; ServerInfo.features lists "
               "distill_topk where it does)");
  std::unique_ptr<Engine> with = MakeEngine(kAllKinds | kDistillTopkBit);
  spec.distill.topk_tail = DistillTopkTail::kRenormalize;
  auto plan = with->Plan(spec);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->input_bytes[static_cast<int>(InputSlot::kTeacherTopkIds)], kBt * 3 * 4u);
  EXPECT_EQ(plan->input_bytes[static_cast<int>(InputSlot::kTeacherTopkLogp)], kBt * 3 * 4u);
  EXPECT_EQ(plan->input_bytes[static_cast<int>(InputSlot::kTeacherX)], 0u);
  EXPECT_EQ(plan->teacher_h, 0);
  EXPECT_EQ(seen_->shape.teacher_topk, 3);
  const ComputeOutcome r = Run(*with, spec);
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_EQ(seen_->problem.teacher_topk, 3);
  EXPECT_EQ(seen_->problem.teacher_topk_id_dtype, DType::kI32);
  EXPECT_EQ(seen_->problem.teacher_h, 0);
  EXPECT_EQ(seen_->problem.distill.topk_tail, DistillTopkTail::kRenormalize);
  const std::vector<std::string> f = ServerFeatures(kAllKinds | kDistillTopkBit);
  EXPECT_NE(std::find(f.begin(), f.end(), "distill_topk"), f.end());
  const std::vector<std::string> g = ServerFeatures(kAllKinds);
  EXPECT_EQ(std::find(g.begin(), g.end(), "distill_topk"), g.end());
}

TEST_F(DistillOptionsTest, TopkIsRefusedNamingTheFieldRowAndValue) {
  std::unique_ptr<Engine> e = MakeEngine(kAllKinds | kDistillTopkBit);
  auto refused = [&](const ComputeSpec& spec, const std::string& message) {
    ExpectStatus(e->Plan(spec).status(), absl::StatusCode::kInvalidArgument, message);
  };
  ComputeSpec spec = TopkSpec(3);
  SetInput(&spec, InputSlot::kTeacherX, InputDesc(DType::kBF16, {kBt, kHt}));
  refused(spec, "header has teacher_topk_ids / teacher_topk_logp and also teacher_x: send the "
                "teacher's top-k or its head, not both");
  spec = TopkSpec(3);
  SetInput(&spec, InputSlot::kTeacherTopkLogp, TensorDesc{});
  refused(spec, "header.teacher_topk_logp is missing: a top-k teacher sends both its ids and "
                "their log-probs (BT, k)");
  spec = TopkSpec(3);
  SetInput(&spec, InputSlot::kTeacherTopkIds, InputDesc(DType::kI32, {kBt, kV + 1}));
  refused(spec, "teacher_topk_ids.shape [6, 10] must be (BT, k) with BT = 6 and k in [1, 9] "
                "(at most V = 9 and 1024)");
  spec = TopkSpec(3);
  SetInput(&spec, InputSlot::kTeacherTopkLogp, InputDesc(DType::kF32, {kBt, 2}));
  refused(spec, "teacher_topk_logp.shape [6, 2] must equal teacher_topk_ids.shape [6, 3]");
  spec = TopkSpec(3);
  SetInput(&spec, InputSlot::kTeacherTopkIds, InputDesc(DType::kF32, {kBt, 3}));
  refused(spec, "teacher_topk_ids.dtype must be int32 or int64, got fp32");
  spec = TopkSpec(3);
  SetInput(&spec, InputSlot::kTeacherTopkLogp, InputDesc(DType::kBF16, {kBt, 3}));
  refused(spec, "teacher_topk_logp.dtype must be fp32, got bf16");
  spec = Spec();
  spec.distill.topk_tail = DistillTopkTail::kNone;
  refused(spec, "header.distill.topk_tail none is for a top-k teacher (teacher_topk_ids, "
                "teacher_topk_logp); this request sends a teacher head");
  spec = TopkSpec(3);
  spec.kind = LossKind::kLogprob;
  refused(spec, "header.teacher_topk_ids is for kind distill; this request's kind is logprob");
  // The values, when they arrive: the one validation names the row (a counted one).
  spec = TopkSpec(3);
  student_.targets[4] = 1;
  ids_[4 * 3 + 2] = static_cast<int32_t>(kV);
  ExpectStatus(Run(*e, spec).status, absl::StatusCode::kInvalidArgument,
               "teacher_topk_ids[4, 2] = 9 is outside [0, V=9)");
  spec = TopkSpec(3);
  logp_[5 * 3] = 0.5f;  // e^0.5 > 1: not one distribution's log-probs
  student_.targets[5] = 2;
  const absl::Status st = Run(*e, spec).status;
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_NE(st.message().find("teacher_topk_logp row 5: its probabilities sum to 1.8"),
            std::string::npos) << st;
}

}  // namespace
}  // namespace lossd
