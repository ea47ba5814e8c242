// SPDX-License-Identifier: Apache-2.0
// The loss kinds through the engine (no gRPC): Plan's refusals, each naming the field and its
// values; the byte counts, outputs and workspace shape of each kind; and each kind's inputs
// reaching the backend and its outputs coming back, with weight handles (the teacher's too),
// accumulators and hosted heads. The backend is KindsBackend (testing/kinds_backend.h),
// which records what it is handed; the kinds' math is the backends' tests'.
#include <algorithm>
#include <cstring>
#include <limits>
#include <future>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/engine.h"
#include "engine/features.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "testing/engine_calls.h"
#include "testing/kinds_backend.h"
#include "testing/test_util.h"

namespace lossd {
namespace {

constexpr int64_t kBt = 6, kH = 5, kV = 9, kHt = 7;
constexpr uint32_t kAllKinds = LossKindBit(LossKind::kCrossEntropy) |
                               LossKindBit(LossKind::kLogprob) |
                               LossKindBit(LossKind::kPolicy) | LossKindBit(LossKind::kDistill);

// A student problem, a teacher of hidden size kHt over the same rows and vocabulary, and
// three random per-row vectors; the spec and buffers of a request of any kind over them.
class KindsTest : public ::testing::Test {
 protected:
  KindsTest()
      : seen_(std::make_shared<KindsSeen>()),
        e_(std::make_unique<KindsBackend>(kAllKinds, seen_), EngineOptions{}),
        student_(RandomProblem::Make(ShapeSpec(kBt, kH, kV))),
        teacher_(RandomProblem::Make(ShapeSpec(kBt, kHt, kV))),
        a_(RandomRows(kBt, 11)), b_(RandomRows(kBt, 12)), c_(RandomRows(kBt, 13)) {
    teacher_bias_ = RandomProblem::Make([] {
                      RandomProblemSpec s = ShapeSpec(kBt, kHt, kV);
                      s.bias = true;
                      return s;
                    }()).bias;
  }

  ComputeSpec Spec(LossKind kind) const {
    ComputeSpec s = ComputeSpecFor(student_);
    s.kind = kind;
    if (kind == LossKind::kPolicy) {
      SetInput(&s, InputSlot::kAdvantages, InputDesc(DType::kF32, {kBt}));
    }
    if (kind == LossKind::kDistill) {
      SetInput(&s, InputSlot::kTeacherX, InputDesc(DType::kBF16, {kBt, kHt}));
      SetInput(&s, InputSlot::kTeacherW, InputDesc(DType::kBF16, {kV, kHt}));
    }
    return s;
  }
  static void Unset(ComputeSpec* s, InputSlot slot) { SetInput(s, slot, TensorDesc{}); }

  // The buffers of every input `plan` sends, from this fixture's tensors.
  std::shared_ptr<Engine::InputBuffers> Inputs(const ComputePlan& plan) const {
    InputSources src{};
    src[static_cast<int>(InputSlot::kX)] = student_.x.data();
    src[static_cast<int>(InputSlot::kW)] = student_.w.data();
    src[static_cast<int>(InputSlot::kTargets)] = student_.targets.data();
    src[static_cast<int>(InputSlot::kDlogp)] = a_.data();
    src[static_cast<int>(InputSlot::kDentropy)] = b_.data();
    src[static_cast<int>(InputSlot::kAdvantages)] = a_.data();
    src[static_cast<int>(InputSlot::kOldLogp)] = b_.data();
    src[static_cast<int>(InputSlot::kRefLogp)] = c_.data();
    src[static_cast<int>(InputSlot::kTeacherX)] = teacher_.x.data();
    src[static_cast<int>(InputSlot::kTeacherW)] = teacher_.w.data();
    src[static_cast<int>(InputSlot::kTeacherBias)] = teacher_bias_.data();
    return InputBuffersFrom(plan, src);
  }

  absl::Status Refusal(const ComputeSpec& spec) { return e_.Plan(spec).status(); }

  ComputeOutcome Run(const ComputeSpec& spec) {
    return PlanAndRun(e_, spec, [this](const ComputePlan& plan) { return Inputs(plan); });
  }

  // Uploads bf16 weights (V, h) and an optional bias; returns the handle.
  std::string Upload(const std::vector<uint8_t>& w, int64_t h, const std::vector<uint8_t>& bias,
                     const std::string& owner = "") {
    auto handle = UploadWeights(e_, DType::kBF16, kV, h, w, bias, owner);
    EXPECT_TRUE(handle.ok()) << handle.status();
    return handle.ok() ? *handle : "";
  }

  std::shared_ptr<KindsSeen> seen_;
  Engine e_;
  RandomProblem student_, teacher_;
  std::vector<uint8_t> teacher_bias_;
  std::vector<float> a_, b_, c_;
};

void ExpectStatus(const absl::Status& s, absl::StatusCode code, const std::string& message) {
  EXPECT_EQ(s.code(), code) << s;
  EXPECT_EQ(s.message(), message);
}

void ExpectRefused(const absl::Status& s, const std::string& message) {
  ExpectStatus(s, absl::StatusCode::kInvalidArgument, message);
}

TEST(LossKindsPlanTest, AKindTheBackendLacksIsUnimplementedNamingTheBackend) {
  RandomProblem rp = RandomProblem::Make(ShapeSpec(kBt, kH, kV));
  ComputeSpec spec = ComputeSpecFor(rp);
  std::shared_ptr<KindsSeen> seen = std::make_shared<KindsSeen>();
  Engine ce_only(std::make_unique<KindsBackend>(LossKindBit(LossKind::kCrossEntropy), seen),
                 EngineOptions{});
  spec.kind = LossKind::kPolicy;
  ExpectStatus(ce_only.Plan(spec).status(), absl::StatusCode::kUnimplemented,
               "this server's backend 'kinds-fake' does not compute kind policy (it computes: "
               "cross_entropy; ServerInfo.features lists loss_kind_<name> for each)");
  spec.kind = static_cast<LossKind>(7);
  ExpectRefused(ce_only.Plan(spec).status(), "header.kind 7 is unknown");
  Engine two(std::make_unique<KindsBackend>(
                 LossKindBit(LossKind::kCrossEntropy) | LossKindBit(LossKind::kLogprob), seen),
             EngineOptions{});
  spec.kind = LossKind::kDistill;
  ExpectStatus(two.Plan(spec).status(), absl::StatusCode::kUnimplemented,
               "this server's backend 'kinds-fake' does not compute kind distill (it computes: "
               "cross_entropy, logprob; ServerInfo.features lists loss_kind_<name> for each)");
}

// Sequence-level importance sampling is a policy option a backend may lack: UNIMPLEMENTED
// naming the backend and the feature before anything else is checked; planned where the
// backend sets kPolicySequenceBit, and announced as policy_sequence_importance_sampling.
TEST(LossKindsPlanTest, SequenceImportanceSamplingNeedsTheBackendsBit) {
  RandomProblem rp = RandomProblem::Make(ShapeSpec(kBt, kH, kV));
  ComputeSpec spec = ComputeSpecFor(rp);
  spec.kind = LossKind::kPolicy;
  SetInput(&spec, InputSlot::kAdvantages, InputDesc(DType::kF32, {kBt}));
  spec.policy.importance_sampling = ImportanceSampling::kSequence;
  spec.policy.sequences = 2;
  std::shared_ptr<KindsSeen> seen = std::make_shared<KindsSeen>();
  Engine token_only(std::make_unique<KindsBackend>(kAllKinds, seen), EngineOptions{});
  ExpectStatus(token_only.Plan(spec).status(), absl::StatusCode::kUnimplemented,
               "this server's backend 'kinds-fake' does not compute "
               "header.policy.importance_sampling IMPORTANCE_SAMPLING_SEQUENCE "
               "(ServerInfo.features lists policy_sequence_importance_sampling where it does)");
  Engine both(std::make_unique<KindsBackend>(kAllKinds | kPolicySequenceBit, seen),
              EngineOptions{});
  auto planned = both.Plan(spec);
  ASSERT_TRUE(planned.ok()) << planned.status();
  EXPECT_EQ(planned->policy.importance_sampling, ImportanceSampling::kSequence);
  spec.policy.loss_type = PolicyLossType::kSapo;
  ExpectRefused(both.Plan(spec).status(), "policy.importance_sampling sequence is for the clipped loss types (dapo, grpo, bnpo, "
                "dr_grpo, luspo); loss type sapo takes token-level ratios only");
  const std::vector<std::string> f = ServerFeatures(kAllKinds | kPolicySequenceBit);
  EXPECT_NE(std::find(f.begin(), f.end(), "policy_sequence_importance_sampling"), f.end());
  EXPECT_TRUE(std::is_sorted(f.begin(), f.end()));
  const std::vector<std::string> g = ServerFeatures(kAllKinds);
  EXPECT_EQ(std::find(g.begin(), g.end(), "policy_sequence_importance_sampling"), g.end());
}

// The rollout correction is_ratio: a policy tensor (BT) fp32, refused for other kinds, and
// UNIMPLEMENTED where the backend lacks kPolicyIsRatioBit; announced as policy_is_ratio.
TEST(LossKindsPlanTest, IsRatioNeedsTheBackendsBit) {
  RandomProblem rp = RandomProblem::Make(ShapeSpec(kBt, kH, kV));
  ComputeSpec spec = ComputeSpecFor(rp);
  spec.kind = LossKind::kPolicy;
  SetInput(&spec, InputSlot::kAdvantages, InputDesc(DType::kF32, {kBt}));
  SetInput(&spec, InputSlot::kIsRatio, InputDesc(DType::kF32, {kBt}));
  std::shared_ptr<KindsSeen> seen = std::make_shared<KindsSeen>();
  Engine without(std::make_unique<KindsBackend>(kAllKinds, seen), EngineOptions{});
  ExpectStatus(without.Plan(spec).status(), absl::StatusCode::kUnimplemented,
               "this server's backend 'kinds-fake' does not compute header.is_ratio "
               "(ServerInfo.features lists policy_is_ratio where it does)");
  Engine with(std::make_unique<KindsBackend>(kAllKinds | kPolicyIsRatioBit, seen),
              EngineOptions{});
  auto planned = with.Plan(spec);
  ASSERT_TRUE(planned.ok()) << planned.status();
  EXPECT_EQ(planned->input_bytes[static_cast<int>(InputSlot::kIsRatio)], kBt * 4u);
  SetInput(&spec, InputSlot::kIsRatio, InputDesc(DType::kF32, {kBt + 1}));
  ExpectRefused(with.Plan(spec).status(), "is_ratio.shape [7] must be (BT) = [6]");
  SetInput(&spec, InputSlot::kIsRatio, InputDesc(DType::kF32, {kBt}));
  spec.kind = LossKind::kLogprob;
  spec.inputs[static_cast<int>(InputSlot::kAdvantages)] = TensorDesc();
  ExpectRefused(with.Plan(spec).status(),
                "header.is_ratio is for kind policy; this request's kind is logprob");
  const std::vector<std::string> f = ServerFeatures(kAllKinds | kPolicyIsRatioBit);
  EXPECT_NE(std::find(f.begin(), f.end(), "policy_is_ratio"), f.end());
}

// verl's menu: each option is UNIMPLEMENTED, naming its field and feature, on a backend
// without its bit, and planned with it; the features name each bit.
TEST(LossKindsPlanTest, VerlOptionsNeedTheBackendsBits) {
  RandomProblem rp = RandomProblem::Make(ShapeSpec(kBt, kH, kV));
  ComputeSpec base = ComputeSpecFor(rp);
  base.kind = LossKind::kPolicy;
  SetInput(&base, InputSlot::kAdvantages, InputDesc(DType::kF32, {kBt}));
  const struct {
    uint32_t bit;
    void (*set)(PolicyParams*);
    const char* message;
  } cases[] = {
      {kPolicyKlEstimatorBit, [](PolicyParams* p) { p->kl_estimator = KlEstimator::kLowVarKl; },
       "does not compute header.policy.kl_estimator low_var_kl (ServerInfo.features lists "
       "policy_kl_estimator where it does)"},
      {kPolicyKlEstimatorBit, [](PolicyParams* p) { p->kl_straight_through = true; },
       "does not compute header.policy.kl_estimator k3 with kl_straight_through "
       "(ServerInfo.features lists policy_kl_estimator where it does)"},
      {kPolicyEntropyBit, [](PolicyParams* p) { p->entropy_coeff = 0.01f; },
       "does not compute header.policy.entropy_coeff 0.01 (ServerInfo.features lists "
       "policy_entropy_bonus where it does)"},
      {kPolicyAggregationBit,
       [](PolicyParams* p) { p->aggregation = PolicyAggregation::kSeqMeanTokenMean; },
       "does not compute header.policy.aggregation seq-mean-token-mean (ServerInfo.features "
       "lists policy_aggregation where it does)"},
      {kPolicyGpgBit, [](PolicyParams* p) { p->loss_type = PolicyLossType::kGpg; },
       "does not compute header.policy.loss_type gpg (ServerInfo.features lists "
       "policy_loss_type_gpg where it does)"},
      {kPolicyGeoMeanBit, [](PolicyParams* p) { p->loss_type = PolicyLossType::kGeoMean; },
       "does not compute header.policy.loss_type geo_mean (ServerInfo.features lists "
       "policy_loss_type_geo_mean where it does)"},
      {kPolicyKlCovBit, [](PolicyParams* p) { p->loss_type = PolicyLossType::kKlCov; },
       "does not compute header.policy.loss_type kl_cov (ServerInfo.features lists "
       "policy_loss_type_kl_cov where it does)"},
  };
  std::shared_ptr<KindsSeen> seen = std::make_shared<KindsSeen>();
  const uint32_t all_verl =
      kPolicyKlEstimatorBit | kPolicyEntropyBit | kPolicyAggregationBit | kPolicyGpgBit |
      kPolicyGeoMeanBit | kPolicyKlCovBit;
  for (const auto& c : cases) {
    ComputeSpec spec = base;
    c.set(&spec.policy);
    Engine without(std::make_unique<KindsBackend>(kAllKinds | (all_verl & ~c.bit), seen),
                   EngineOptions{});
    ExpectStatus(without.Plan(spec).status(), absl::StatusCode::kUnimplemented,
                 absl::StrCat("this server's backend 'kinds-fake' ", c.message));
    Engine with(std::make_unique<KindsBackend>(kAllKinds | c.bit, seen), EngineOptions{});
    auto planned = with.Plan(spec);
    EXPECT_TRUE(planned.ok()) << planned.status();
  }
  // Validated once, before the backend is asked.
  ComputeSpec bad = base;
  bad.policy.loss_scale_factor = 8;
  Engine with(std::make_unique<KindsBackend>(kAllKinds | all_verl, seen), EngineOptions{});
  ExpectRefused(with.Plan(bad).status(),
                "policy.loss_scale_factor 8 is for aggregation seq-mean-token-sum-norm; this "
                "request's is loss_type");
  const std::vector<std::string> f = ServerFeatures(kAllKinds | all_verl);
  for (const char* name : {"policy_kl_estimator", "policy_entropy_bonus", "policy_aggregation",
                           "policy_loss_type_gpg"}) {
    EXPECT_NE(std::find(f.begin(), f.end(), name), f.end()) << name;
    const std::vector<std::string> none = ServerFeatures(kAllKinds);
    EXPECT_EQ(std::find(none.begin(), none.end(), name), none.end()) << name;
  }
}

// Admission counts a kind's own memory: the CPU backend's workspace for distill holds a chunk
// of teacher logits beside the student's, and the inline teacher's bytes are host bytes.
TEST(LossKindsPlanTest, AdmissionCountsTheKindsWorkspaceAndTheTeachersBytes) {
  Engine e(NewCpuBackend(1), EngineOptions{});
  RandomProblem rp = RandomProblem::Make(ShapeSpec(kBt, kH, kV));
  ComputeSpec ce = ComputeSpecFor(rp);
  ComputeSpec distill = ce;
  distill.kind = LossKind::kDistill;
  distill.inputs[static_cast<int>(InputSlot::kTeacherX)] = InputDesc(DType::kBF16, {kBt, kHt});
  distill.inputs[static_cast<int>(InputSlot::kTeacherW)] = InputDesc(DType::kBF16, {kV, kHt});
  auto a = e.Plan(ce);
  auto b = e.Plan(distill);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_GT(b->workspace_bytes, a->workspace_bytes);
  EXPECT_EQ(b->host_bytes - a->host_bytes, (kBt + kV) * kHt * 2u);
  EXPECT_GT(b->flops(), a->flops());
}

TEST(LossKindsPlanTest, TheFeaturesNameEveryKindTheBackendComputes) {
  std::vector<std::string> ce = ServerFeatures(LossKindBit(LossKind::kCrossEntropy));
  EXPECT_EQ(ce, std::vector<std::string>(kServerFeatures.begin(), kServerFeatures.end()));
  std::vector<std::string> all = ServerFeatures(kAllKinds);
  EXPECT_EQ(all.size(), kServerFeatures.size() + 4);
  EXPECT_TRUE(std::is_sorted(all.begin(), all.end()));
  for (const char* f : {"loss_kind_distill", "loss_kind_logprob", "loss_kind_policy",
                        "logprob_two_phase"}) {
    EXPECT_NE(std::find(all.begin(), all.end(), f), all.end()) << f;
  }
  std::vector<std::string> two =
      ServerFeatures(LossKindBit(LossKind::kCrossEntropy) | LossKindBit(LossKind::kPolicy));
  EXPECT_NE(std::find(two.begin(), two.end(), "loss_kind_policy"), two.end());
  EXPECT_EQ(std::find(two.begin(), two.end(), "loss_kind_logprob"), two.end());
  EXPECT_EQ(std::find(two.begin(), two.end(), "logprob_two_phase"), two.end());
  EXPECT_EQ(std::find(two.begin(), two.end(), "loss_kind_distill"), two.end());
}

TEST_F(KindsTest, EachKindPlansItsBytesOutputsAndWorkspaceShape) {
  ComputeSpec spec = Spec(LossKind::kLogprob);
  SetInput(&spec, InputSlot::kDlogp, InputDesc(DType::kF32, {kBt}));
  spec.wanted.entropy = true;
  spec.options.temperature = 0.5f;
  auto plan = e_.Plan(spec);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->input_bytes[static_cast<int>(InputSlot::kDlogp)], kBt * 4u);
  EXPECT_EQ(plan->input_bytes[static_cast<int>(InputSlot::kDentropy)], 0u);
  std::vector<OutputSlot> slots;
  for (const OutputDesc& d : plan->outputs) slots.push_back(d.slot);
  EXPECT_EQ(slots, (std::vector<OutputSlot>{OutputSlot::kLogp, OutputSlot::kEntropy,
                                            OutputSlot::kDx, OutputSlot::kDw}));
  EXPECT_EQ(seen_->shape.kind, LossKind::kLogprob);
  EXPECT_TRUE(seen_->shape.want_entropy);
  EXPECT_EQ(plan->options.temperature, 0.5f);

  spec = Spec(LossKind::kDistill);
  Unset(&spec, InputSlot::kTargets);
  SetInput(&spec, InputSlot::kTeacherBias, InputDesc(DType::kBF16, {kV}));
  plan = e_.Plan(spec);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->input_bytes[static_cast<int>(InputSlot::kTargets)], 0u);
  EXPECT_EQ(plan->input_bytes[static_cast<int>(InputSlot::kTeacherX)], kBt * kHt * 2u);
  EXPECT_EQ(plan->input_bytes[static_cast<int>(InputSlot::kTeacherW)], kV * kHt * 2u);
  EXPECT_EQ(plan->input_bytes[static_cast<int>(InputSlot::kTeacherBias)], kV * 2u);
  EXPECT_EQ(plan->teacher_h, kHt);
  EXPECT_EQ(seen_->shape.kind, LossKind::kDistill);
  EXPECT_EQ(seen_->shape.teacher_h, kHt);
  EXPECT_EQ(seen_->shape.teacher_w_memory, Memory::kHost);
  EXPECT_EQ(plan->outputs.size(), 2u);  // dx, dw: no logp
}

TEST_F(KindsTest, AnotherKindsTensorsAndOutputsAreRefusedNamingTheField) {
  ComputeSpec spec = Spec(LossKind::kPolicy);
  SetInput(&spec, InputSlot::kDlogp, InputDesc(DType::kF32, {kBt}));
  ExpectRefused(Refusal(spec), "header.dlogp is for kind logprob; this request's kind is policy");
  spec = Spec(LossKind::kLogprob);
  SetInput(&spec, InputSlot::kRefLogp, InputDesc(DType::kF32, {kBt}));
  ExpectRefused(Refusal(spec),
                "header.ref_logp is for kind policy; this request's kind is logprob");
  spec = Spec(LossKind::kCrossEntropy);
  SetInput(&spec, InputSlot::kTeacherX, InputDesc(DType::kBF16, {kBt, kHt}));
  ExpectRefused(Refusal(spec),
                "header.teacher_x is for kind distill; this request's kind is cross_entropy");
  spec = Spec(LossKind::kPolicy);
  spec.teacher_weight_handle = "w-x-1";
  ExpectRefused(Refusal(spec),
                "header.teacher_weight_handle is for kind distill; this request's kind is "
                "policy");
  spec = Spec(LossKind::kPolicy);
  spec.wanted.entropy = true;
  ExpectRefused(Refusal(spec),
                "header.outputs.entropy is for kind logprob; this request's kind is policy");
  spec = Spec(LossKind::kDistill);
  spec.wanted.z_loss = true;
  ExpectRefused(Refusal(spec),
                "header.outputs.z_loss is for kind cross_entropy; this request's kind is "
                "distill");
  spec.wanted.z_loss = false;
  spec.wanted.accuracy = true;
  ExpectRefused(Refusal(spec),
                "header.outputs.accuracy is for kind cross_entropy; this request's kind is "
                "distill");
  spec.wanted.accuracy = false;
  spec.wanted.lse = true;  // every kind's: the student's at the temperature
  EXPECT_TRUE(e_.Plan(spec).ok()) << e_.Plan(spec).status();
  spec = Spec(LossKind::kLogprob);
  spec.options.label_smoothing = 0.1f;
  ExpectRefused(Refusal(spec),
                "options.label_smoothing 0.1 is for cross_entropy only; kind logprob takes 0");
  spec = Spec(LossKind::kPolicy);
  SetInput(&spec, InputSlot::kClassWeights, InputDesc(DType::kF32, {kV}));
  ExpectRefused(Refusal(spec),
                "class_weights is for cross_entropy only; kind policy does not take it");
  spec = Spec(LossKind::kCrossEntropy);
  spec.options.temperature = 2.0f;
  ExpectRefused(Refusal(spec),
                "options.temperature 2 applies to kinds logprob, policy and distill; "
                "cross_entropy takes 1 (scale the logits by the head instead)");
  spec = Spec(LossKind::kLogprob);
  spec.options.temperature = -1.0f;
  ExpectRefused(Refusal(spec), "options.temperature must be finite and > 0, got -1");
}

TEST_F(KindsTest, EachKindsOwnInputsAreCheckedNamingFieldAndValues) {
  ComputeSpec spec = Spec(LossKind::kPolicy);
  Unset(&spec, InputSlot::kAdvantages);
  ExpectRefused(Refusal(spec),
                "header.advantages is missing: kind policy needs one advantage per row (BT) "
                "fp32");
  spec = Spec(LossKind::kPolicy);
  SetInput(&spec, InputSlot::kOldLogp, InputDesc(DType::kF32, {kBt + 1}));
  ExpectRefused(Refusal(spec), "old_logp.shape [7] must be (BT) = [6]");
  SetInput(&spec, InputSlot::kOldLogp, InputDesc(DType::kBF16, {kBt}));
  ExpectRefused(Refusal(spec), "old_logp.dtype must be fp32, got bf16");
  spec = Spec(LossKind::kPolicy);
  spec.policy.sequences = 4;
  ExpectRefused(Refusal(spec),
                "policy.sequences 4 must be > 0 and divide the rows (BT=6): the rows are that "
                "many sequences of equal length");
  spec.policy.sequences = 3;
  spec.policy.loss_type = PolicyLossType::kDrGrpo;
  ExpectRefused(Refusal(spec),
                "policy.max_completion_length must be > 0 for loss type dr_grpo, got 0");
  spec = Spec(LossKind::kDistill);
  spec.distill.jsd_beta = 2.0f;
  ExpectRefused(Refusal(spec), "distill.jsd_beta must be in [0, 1], got 2");
  spec = Spec(LossKind::kDistill);
  Unset(&spec, InputSlot::kTeacherX);
  ExpectRefused(Refusal(spec),
                "header.teacher_x is missing: kind distill needs the teacher's hidden states "
                "(BT, Ht)");
  spec = Spec(LossKind::kDistill);
  SetInput(&spec, InputSlot::kTeacherX, InputDesc(DType::kF32, {kBt, kHt}));
  ExpectRefused(Refusal(spec), "teacher_x.dtype fp32 differs from x.dtype bf16");
  SetInput(&spec, InputSlot::kTeacherX, InputDesc(DType::kBF16, {kBt - 1, kHt}));
  ExpectRefused(Refusal(spec),
                "teacher_x.shape [5, 7] must be (BT, Ht) with BT = x.shape[0] = 6");
  spec = Spec(LossKind::kDistill);
  SetInput(&spec, InputSlot::kTeacherW, InputDesc(DType::kBF16, {kV, kHt + 1}));
  ExpectRefused(Refusal(spec),
                "teacher_w.shape [9, 8] must be (V, Ht) = [9, 7] (the student's V, "
                "teacher_x's hidden size)");
  Unset(&spec, InputSlot::kTeacherW);
  ExpectRefused(Refusal(spec),
                "header has neither teacher_w nor teacher_weight_handle: kind distill needs "
                "the teacher's weights");
  spec = Spec(LossKind::kDistill);
  SetInput(&spec, InputSlot::kTeacherBias, InputDesc(DType::kBF16, {kV + 2}));
  ExpectRefused(Refusal(spec), "teacher_bias.shape [11] must be (V) = [9]");
  spec = Spec(LossKind::kLogprob);
  Unset(&spec, InputSlot::kTargets);  // only distill may leave them out
  ExpectRefused(Refusal(spec), "header.targets is missing");
}

TEST_F(KindsTest, TheTeachersHandleMustBeTheCallersAndFitTheTeacher) {
  const std::string mine = Upload(teacher_.w, kHt, {}, "alice");
  const std::string wrong_h = Upload(student_.w, kH, {});
  ComputeSpec spec = Spec(LossKind::kDistill);
  Unset(&spec, InputSlot::kTeacherW);
  spec.teacher_weight_handle = mine;
  spec.owner = "bob";
  absl::Status denied = Refusal(spec);
  EXPECT_EQ(denied.code(), absl::StatusCode::kPermissionDenied) << denied;
  EXPECT_NE(denied.message().find(absl::StrCat("weight handle '", mine, "' belongs to another")),
            std::string::npos) << denied;
  spec.owner = "alice";
  EXPECT_TRUE(e_.Plan(spec).ok());
  SetInput(&spec, InputSlot::kTeacherBias, InputDesc(DType::kBF16, {kV}));
  ExpectRefused(Refusal(spec),
                absl::StrCat("header names teacher_weight_handle '", mine,
                             "' and also describes inline teacher_bias; send one or the other "
                             "(a handle carries its own bias)"));
  Unset(&spec, InputSlot::kTeacherBias);
  spec.teacher_weight_handle = wrong_h;
  ExpectRefused(Refusal(spec),
                absl::StrCat("the weights of teacher_weight_handle '", wrong_h,
                             "' are (V=9, H=5, bf16); the teacher must be (V=9, H=7 = "
                             "teacher_x.shape[1], bf16)"));
  spec.teacher_weight_handle = "w-nowhere-1";
  EXPECT_EQ(Refusal(spec).code(), absl::StatusCode::kNotFound);
}

TEST_F(KindsTest, LogprobsInputsReachTheBackendAndItsOutputsComeBack) {
  ComputeSpec spec = Spec(LossKind::kLogprob);
  SetInput(&spec, InputSlot::kDlogp, InputDesc(DType::kF32, {kBt}));
  SetInput(&spec, InputSlot::kDentropy, InputDesc(DType::kF32, {kBt}));
  spec.wanted.entropy = true;
  spec.options.temperature = 0.75f;
  spec.options.grad_scale = 0.5f;
  ComputeOutcome o = Run(spec);
  ASSERT_TRUE(o.status.ok()) << o.status;
  ASSERT_EQ(seen_->computes, 1);
  EXPECT_EQ(seen_->problem.kind, LossKind::kLogprob);
  EXPECT_EQ(seen_->dlogp, a_);
  EXPECT_EQ(seen_->dentropy, b_);
  EXPECT_TRUE(seen_->advantages.empty());
  EXPECT_EQ(seen_->problem.options.temperature, 0.75f);
  EXPECT_EQ(seen_->problem.options.grad_scale, 0.5f);
  // Cross-entropy's outputs are not asked of it, nor policy's metrics.
  EXPECT_EQ(seen_->outputs.accuracy, nullptr);
  EXPECT_EQ(seen_->outputs.kl, nullptr);
  EXPECT_EQ(seen_->outputs.lse, nullptr);
  EXPECT_EQ(o.loss, kFakeLoss);
  EXPECT_EQ(o.tokens, kBt);
  ASSERT_EQ(o.outputs.size(), 4u);  // logp, entropy, dx, dw
  const float* logp = reinterpret_cast<const float*>(o.outputs[0].get());
  const float* entropy = reinterpret_cast<const float*>(o.outputs[1].get());
  for (int64_t i = 0; i < kBt; ++i) {
    EXPECT_EQ(logp[i], static_cast<float>(i) + a_[i]) << i;
    EXPECT_EQ(entropy[i], FakeEntropy(i)) << i;
  }
}

TEST_F(KindsTest, PolicyIntoAnAccumulatorCarriesItsInputsParamsAndMetrics) {
  ComputeSpec spec = Spec(LossKind::kPolicy);
  SetInput(&spec, InputSlot::kOldLogp, InputDesc(DType::kF32, {kBt}));
  SetInput(&spec, InputSlot::kRefLogp, InputDesc(DType::kF32, {kBt}));
  spec.policy.loss_type = PolicyLossType::kGrpo;
  spec.policy.sequences = 2;
  spec.policy.beta = 0.3f;
  spec.policy.epsilon_high = 0.28f;
  spec.accumulator = "rl";
  spec.wanted.dw = false;
  for (int mb = 1; mb <= 2; ++mb) {
    ComputeOutcome o = Run(spec);
    ASSERT_TRUE(o.status.ok()) << o.status;
    EXPECT_EQ(o.kl, kFakeKl);
    EXPECT_EQ(o.clip_fraction, kFakeClipFraction);
    EXPECT_EQ(o.accumulated_micro_batches, static_cast<uint64_t>(mb));
    ASSERT_EQ(o.outputs.size(), 1u);  // dx
    EXPECT_EQ(o.outputs.size(), 1u);
  }
  EXPECT_EQ(seen_->advantages, a_);
  EXPECT_EQ(seen_->old_logp, b_);
  EXPECT_EQ(seen_->ref_logp, c_);
  EXPECT_EQ(seen_->problem.policy.loss_type, PolicyLossType::kGrpo);
  EXPECT_EQ(seen_->problem.policy.sequences, 2);
  EXPECT_EQ(seen_->problem.policy.beta, 0.3f);
  EXPECT_EQ(seen_->problem.policy.epsilon_high, 0.28f);
  EXPECT_EQ(seen_->outputs.logp, nullptr);
  EXPECT_EQ(seen_->shape.dw, GradOut::kAccumulated);
  auto g = e_.FetchGradients("rl", false);
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(g->micro_batches, 2u);
  const float* dw = reinterpret_cast<const float*>(g->data.get());
  for (int64_t i = 0; i < kV * kH; ++i) ASSERT_EQ(dw[i], 2.0f) << i;
}

TEST_F(KindsTest, DistillTakesTheTeacherByHandleWithItsBiasAndNoTargets) {
  const std::string handle = Upload(teacher_.w, kHt, teacher_bias_);
  ComputeSpec spec = Spec(LossKind::kDistill);
  Unset(&spec, InputSlot::kTeacherW);
  Unset(&spec, InputSlot::kTargets);
  spec.teacher_weight_handle = handle;
  spec.distill.jsd_beta = 0.25f;
  spec.options.temperature = 2.0f;
  auto plan = e_.Plan(spec);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(seen_->shape.teacher_w_memory, Memory::kBackend);
  EXPECT_EQ(plan->input_bytes[static_cast<int>(InputSlot::kTeacherW)], 0u);
  ComputeOutcome o = RunSync(e_, *plan, Inputs(*plan));
  ASSERT_TRUE(o.status.ok()) << o.status;
  EXPECT_EQ(o.loss, kFakeLoss);
  EXPECT_TRUE(seen_->targets_null);
  EXPECT_EQ(seen_->problem.teacher_h, kHt);
  EXPECT_EQ(seen_->problem.teacher_w_memory, Memory::kBackend);
  EXPECT_EQ(seen_->teacher_x, teacher_.x);
  EXPECT_EQ(seen_->teacher_w, teacher_.w);
  EXPECT_EQ(seen_->teacher_bias, teacher_bias_);
  EXPECT_EQ(seen_->problem.distill.jsd_beta, 0.25f);
  EXPECT_EQ(seen_->problem.options.temperature, 2.0f);
}

TEST_F(KindsTest, AnInlineTeachersNonFiniteValuesAreRefusedNamingTheTensor) {
  ComputeSpec spec = Spec(LossKind::kDistill);
  SetInput(&spec, InputSlot::kTeacherBias, InputDesc(DType::kBF16, {kV}));
  auto plan = e_.Plan(spec);
  ASSERT_TRUE(plan.ok()) << plan.status();
  ComputeOutcome o = RunSync(e_, *plan, Inputs(*plan));
  ASSERT_TRUE(o.status.ok()) << o.status;
  EXPECT_EQ(seen_->teacher_w, teacher_.w);
  EXPECT_EQ(seen_->teacher_bias, teacher_bias_);
  EXPECT_EQ(seen_->problem.teacher_w_memory, Memory::kHost);
  EXPECT_FALSE(seen_->targets_null);
  const uint16_t nan_bf16 = 0x7fc0;
  for (InputSlot slot : {InputSlot::kTeacherX, InputSlot::kTeacherW, InputSlot::kTeacherBias}) {
    auto in = Inputs(*plan);
    std::memcpy((*in)[static_cast<int>(slot)].get() + 2, &nan_bf16, 2);  // element 1
    o = RunSync(e_, *plan, in);
    EXPECT_EQ(o.status.code(), absl::StatusCode::kInvalidArgument) << o.status;
    EXPECT_NE(o.status.message().find(InputSlotName(slot)), std::string::npos) << o.status;
  }
  ComputeSpec policy = Spec(LossKind::kPolicy);
  plan = e_.Plan(policy);
  ASSERT_TRUE(plan.ok()) << plan.status();
  auto in = Inputs(*plan);
  reinterpret_cast<float*>((*in)[static_cast<int>(InputSlot::kAdvantages)].get())[3] =
      std::numeric_limits<float>::infinity();
  o = RunSync(e_, *plan, in);
  EXPECT_EQ(o.status.code(), absl::StatusCode::kInvalidArgument) << o.status;
  EXPECT_NE(o.status.message().find("advantages"), std::string::npos) << o.status;
  EXPECT_EQ(seen_->computes, 1);  // the refused ones never reached the backend
}

TEST_F(KindsTest, AHostedHeadsComputeCopyIsTheStudentOfEveryKind) {
  HeadSpec hs;
  hs.name = "policy-head";
  hs.v = kV;
  hs.h = kH;
  hs.master_dtype = DType::kBF16;
  hs.compute_dtype = DType::kBF16;
  const absl::Status created = CreateHead(e_, hs, student_.w);
  ASSERT_TRUE(created.ok()) << created;
  uint64_t mb = 0;
  for (LossKind kind : {LossKind::kLogprob, LossKind::kPolicy, LossKind::kDistill}) {
    SCOPED_TRACE(LossKindName(kind));
    ComputeSpec spec = Spec(kind);
    Unset(&spec, InputSlot::kW);
    spec.wanted.dw = false;
    spec.head = "policy-head";
    spec.micro_batch = ++mb;
    ComputeOutcome o = Run(spec);
    ASSERT_TRUE(o.status.ok()) << o.status;
    EXPECT_TRUE(o.head_added);
    EXPECT_EQ(seen_->problem.kind, kind);
    EXPECT_EQ(seen_->problem.w_memory, Memory::kBackend);
    EXPECT_NE(seen_->outputs.dw_accum, nullptr);
    std::vector<uint8_t> w(student_.w.size());
    std::memcpy(w.data(), seen_->problem.w, w.size());  // CPU backend memory: host memory
    EXPECT_EQ(w, student_.w);
  }
}

}  // namespace
}  // namespace lossd
