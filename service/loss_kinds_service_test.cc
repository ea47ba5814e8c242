// SPDX-License-Identifier: Apache-2.0
// The loss kinds over the wire, through a real server (testing/server_harness) whose backend
// records what it is handed (testing/kinds_backend.h): ServerInfo's features, each kind's
// header fields and tensors reaching the backend, its outputs and summary fields coming back
// (plain and overlapped), and the service's refusals naming the header field. The kinds'
// math is the backends' tests'.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "engine/features.h"
#include "gtest/gtest.h"
#include "lossd/v1/lossd.grpc.pb.h"
#include "testing/kinds_backend.h"
#include "testing/server_harness.h"
#include "testing/test_util.h"

namespace lossd {
namespace testing_harness {
namespace {

constexpr int64_t kBt = 8, kH = 6, kV = 11, kHt = 5;
constexpr size_t kPartBytes = 40;  // several parts per tensor
constexpr uint32_t kAllKinds = LossKindBit(LossKind::kCrossEntropy) |
                               LossKindBit(LossKind::kLogprob) |
                               LossKindBit(LossKind::kPolicy) | LossKindBit(LossKind::kDistill);

v1::TensorSpec F32Rows() {
  v1::TensorSpec s;
  s.set_dtype(v1::DTYPE_FP32);
  s.add_shape(kBt);
  return s;
}

v1::TensorSpec Bf16(int64_t rows, int64_t cols) {
  v1::TensorSpec s;
  s.set_dtype(v1::DTYPE_BF16);
  s.add_shape(rows);
  s.add_shape(cols);
  return s;
}

void AddParts(std::vector<v1::ComputeRequest>* out, v1::TensorId id, const void* data,
              size_t bytes) {
  const uint8_t* p = static_cast<const uint8_t*>(data);
  for (size_t off = 0; off < bytes; off += kPartBytes) {
    v1::ComputeRequest r;
    r.mutable_part()->set_tensor(id);
    r.mutable_part()->set_offset(off);
    r.mutable_part()->set_data(p + off, std::min(kPartBytes, bytes - off));
    out->push_back(std::move(r));
  }
}

std::vector<float> RandomRows(uint64_t seed) {
  std::mt19937_64 g(seed);
  std::uniform_real_distribution<float> u(-3.0f, 3.0f);
  std::vector<float> r(kBt);
  for (float& f : r) f = u(g);
  return r;
}

class LossKindsServiceTest : public ::testing::Test {
 protected:
  LossKindsServiceTest()
      : seen_(std::make_shared<KindsSeen>()),
        h_([this] {
          HarnessOptions o;
          std::shared_ptr<KindsSeen> seen = seen_;
          o.backend = [seen] { return std::make_unique<KindsBackend>(kAllKinds, seen); };
          return o;
        }()),
        student_(RandomProblem::Make(ShapeSpec(kBt, kH, kV))),
        teacher_(RandomProblem::Make(ShapeSpec(kBt, kHt, kV))),
        a_(RandomRows(21)), b_(RandomRows(22)), c_(RandomRows(23)) {}

  // The student's header of `kind` with dx and dw wanted, and its X, W and targets' parts.
  v1::ComputeHeader Header(v1::LossKind kind) const {
    v1::ComputeHeader h = HeaderFor(student_);
    h.set_kind(kind);
    h.clear_outputs();
    h.mutable_outputs()->set_dx(true);
    h.mutable_outputs()->set_dw(true);
    return h;
  }
  std::vector<v1::ComputeRequest> Parts() const { return PartsFor(student_, kPartBytes); }

  std::shared_ptr<KindsSeen> seen_;
  Harness h_;
  RandomProblem student_, teacher_;
  std::vector<float> a_, b_, c_;
};

TEST_F(LossKindsServiceTest, ServerInfoListsEveryKindTheBackendComputes) {
  grpc::ClientContext ctx;
  v1::ServerInfoResponse info;
  ASSERT_TRUE(h_.stub().ServerInfo(&ctx, v1::ServerInfoRequest(), &info).ok());
  std::vector<std::string> features(info.features().begin(), info.features().end());
  EXPECT_EQ(features, ServerFeatures(kAllKinds));
  for (const char* f : {"loss_kind_logprob", "loss_kind_policy", "loss_kind_distill",
                        "logprob_two_phase"}) {
    EXPECT_NE(std::find(features.begin(), features.end(), f), features.end()) << f;
  }
}

TEST_F(LossKindsServiceTest, LogprobSendsItsGradientsAndGetsLogpAndEntropyBack) {
  v1::ComputeHeader h = Header(v1::LOSS_KIND_LOGPROB);
  *h.mutable_dlogp() = F32Rows();
  *h.mutable_dentropy() = F32Rows();
  h.mutable_options()->set_temperature(0.6f);
  h.mutable_outputs()->set_entropy(true);
  std::vector<v1::ComputeRequest> parts = Parts();
  AddParts(&parts, v1::TENSOR_DLOGP, a_.data(), a_.size() * 4);
  AddParts(&parts, v1::TENSOR_DENTROPY, b_.data(), b_.size() * 4);
  for (bool overlap : {false, true}) {
    SCOPED_TRACE(overlap ? "overlapped" : "plain");
    h.set_overlap(overlap);
    ComputeReply r = RunCompute(h_.stub(), h, overlap ? XLast(parts) : parts);
    ASSERT_TRUE(r.status.ok()) << r.status.error_message();
    EXPECT_EQ(seen_->problem.kind, LossKind::kLogprob);
    EXPECT_EQ(seen_->problem.options.temperature, 0.6f);
    EXPECT_EQ(seen_->dlogp, a_);
    EXPECT_EQ(seen_->dentropy, b_);
    EXPECT_EQ(r.summary.loss(), kFakeLoss);
    EXPECT_EQ(r.summary.tokens(), kBt);
    ASSERT_EQ(r.tensors[v1::TENSOR_LOGP].size(), kBt * 4u);
    ASSERT_EQ(r.tensors[v1::TENSOR_ENTROPY].size(), kBt * 4u);
    for (int64_t i = 0; i < kBt; ++i) {
      float logp, entropy;
      std::memcpy(&logp, r.tensors[v1::TENSOR_LOGP].data() + 4 * i, 4);
      std::memcpy(&entropy, r.tensors[v1::TENSOR_ENTROPY].data() + 4 * i, 4);
      EXPECT_EQ(logp, static_cast<float>(i) + a_[i]) << i;
      EXPECT_EQ(entropy, FakeEntropy(i)) << i;
    }
    EXPECT_EQ(r.tensors[v1::TENSOR_DX].size(), kBt * kH * 2u);
  }
}

TEST_F(LossKindsServiceTest, PolicysOptionsReachTheBackendAndItsMetricsComeBack) {
  v1::ComputeHeader h = Header(v1::LOSS_KIND_POLICY);
  *h.mutable_advantages() = F32Rows();
  *h.mutable_old_logp() = F32Rows();
  *h.mutable_ref_logp() = F32Rows();
  v1::PolicyOptions* p = h.mutable_policy();
  p->set_loss_type(v1::POLICY_LOSS_DR_GRPO);
  p->set_epsilon_low(0.1f);
  p->set_beta(0.0f);  // set to 0: not the default 0.04
  p->set_sequences(4);
  p->set_max_completion_length(3);
  p->set_dapo_normalizer(7.5);
  p->set_sapo_temperature_neg(0.5f);
  p->set_delta(1.5f);
  p->set_use_bias_correction_kl(true);
  h.set_accumulator("rl-acc");
  std::vector<v1::ComputeRequest> parts = Parts();
  AddParts(&parts, v1::TENSOR_ADVANTAGES, a_.data(), a_.size() * 4);
  AddParts(&parts, v1::TENSOR_OLD_LOGP, b_.data(), b_.size() * 4);
  AddParts(&parts, v1::TENSOR_REF_LOGP, c_.data(), c_.size() * 4);
  ComputeReply r = RunCompute(h_.stub(), h, parts);
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  const PolicyParams& got = seen_->problem.policy;
  EXPECT_EQ(got.loss_type, PolicyLossType::kDrGrpo);
  EXPECT_EQ(got.epsilon_low, 0.1f);
  EXPECT_EQ(got.epsilon_high, PolicyParams().epsilon_high);  // unset: Liger's default
  EXPECT_EQ(got.beta, 0.0f);
  EXPECT_EQ(got.sequences, 4);
  EXPECT_EQ(got.max_completion_length, 3);
  EXPECT_EQ(got.dapo_normalizer, 7.5);
  EXPECT_EQ(got.sapo_temperature_pos, PolicyParams().sapo_temperature_pos);  // unset: 1.0
  EXPECT_EQ(got.sapo_temperature_neg, 0.5f);
  EXPECT_EQ(got.delta, 1.5f);
  EXPECT_TRUE(got.use_bias_correction_kl);
  EXPECT_EQ(seen_->advantages, a_);
  EXPECT_EQ(seen_->old_logp, b_);
  EXPECT_EQ(seen_->ref_logp, c_);
  EXPECT_EQ(r.summary.kl(), kFakeKl);
  EXPECT_EQ(r.summary.clip_fraction(), kFakeClipFraction);
  EXPECT_EQ(r.summary.accumulated_micro_batches(), 1u);
  EXPECT_EQ(r.tensors.count(v1::TENSOR_DW), 0u);  // accumulated
  EXPECT_EQ(r.tensors.count(v1::TENSOR_LOGP), 0u);
}

TEST_F(LossKindsServiceTest, DistillTakesATeacherHandleOrAnInlineTeacher) {
  std::string handle;
  ASSERT_TRUE(PutWeights(h_.stub(), teacher_, kPartBytes, &handle).ok());
  v1::ComputeHeader h = Header(v1::LOSS_KIND_DISTILL);
  h.clear_targets();
  *h.mutable_teacher_x() = Bf16(kBt, kHt);
  h.set_teacher_weight_handle(handle);
  h.mutable_distill()->set_jsd_beta(0.0f);  // set to 0: not the default 0.5
  std::vector<v1::ComputeRequest> parts;
  for (v1::ComputeRequest& m : Parts()) {
    if (m.part().tensor() != v1::TENSOR_TARGETS) parts.push_back(std::move(m));
  }
  AddParts(&parts, v1::TENSOR_TEACHER_X, teacher_.x.data(), teacher_.x.size());
  ComputeReply r = RunCompute(h_.stub(), h, parts);
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  EXPECT_TRUE(seen_->targets_null);
  EXPECT_EQ(seen_->problem.teacher_w_memory, Memory::kBackend);
  EXPECT_EQ(seen_->problem.distill.jsd_beta, 0.0f);
  EXPECT_EQ(seen_->teacher_x, teacher_.x);
  EXPECT_EQ(seen_->teacher_w, teacher_.w);
  EXPECT_EQ(r.summary.loss(), kFakeLoss);
  EXPECT_EQ(r.summary.kl(), 0.0f);  // policy's alone

  // Inline, overlapped: the teacher's tensors come before X.
  h.clear_teacher_weight_handle();
  *h.mutable_teacher_w() = Bf16(kV, kHt);
  h.set_overlap(true);
  AddParts(&parts, v1::TENSOR_TEACHER_W, teacher_.w.data(), teacher_.w.size());
  r = RunCompute(h_.stub(), h, XLast(parts));
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  EXPECT_EQ(seen_->problem.teacher_w_memory, Memory::kHost);
  EXPECT_EQ(seen_->teacher_w, teacher_.w);
  EXPECT_EQ(seen_->teacher_x, teacher_.x);
}

TEST_F(LossKindsServiceTest, TheServiceRefusesNamingTheHeaderField) {
  v1::ComputeHeader h = Header(v1::LOSS_KIND_LOGPROB);
  h.mutable_policy()->set_beta(0.1f);
  ComputeReply r = RunCompute(h_.stub(), h, Parts());
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(r.status.error_message(),
            "header.policy is for header.kind LOSS_KIND_POLICY; this request's kind is "
            "LOSS_KIND_LOGPROB");
  h = Header(v1::LOSS_KIND_POLICY);
  *h.mutable_advantages() = F32Rows();
  h.mutable_distill();
  r = RunCompute(h_.stub(), h, Parts());
  EXPECT_EQ(r.status.error_message(),
            "header.distill is for header.kind LOSS_KIND_DISTILL; this request's kind is "
            "LOSS_KIND_POLICY");
  // A part of a tensor the header does not send, and a NaN in a per-row input.
  h = Header(v1::LOSS_KIND_POLICY);
  *h.mutable_advantages() = F32Rows();
  std::vector<v1::ComputeRequest> parts = Parts();
  std::vector<float> bad = a_;
  bad[5] = std::nanf("");
  AddParts(&parts, v1::TENSOR_ADVANTAGES, bad.data(), bad.size() * 4);
  r = RunCompute(h_.stub(), h, parts);
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(r.status.error_message().find("advantages"), std::string::npos)
      << r.status.error_message();
  parts = Parts();
  AddParts(&parts, v1::TENSOR_ADVANTAGES, a_.data(), a_.size() * 4);
  AddParts(&parts, v1::TENSOR_DLOGP, a_.data(), a_.size() * 4);
  r = RunCompute(h_.stub(), h, parts);
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(r.status.error_message().find("a part of dlogp arrived but the header does not "
                                          "send dlogp"),
            std::string::npos) << r.status.error_message();
  // An option out of range, named by the one validation.
  h = Header(v1::LOSS_KIND_POLICY);
  *h.mutable_advantages() = F32Rows();
  h.mutable_policy()->set_loss_type(v1::POLICY_LOSS_SAPO);
  h.mutable_policy()->set_sapo_temperature_pos(-1.0f);
  parts = Parts();
  AddParts(&parts, v1::TENSOR_ADVANTAGES, a_.data(), a_.size() * 4);
  r = RunCompute(h_.stub(), h, parts);
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(r.status.error_message().find("policy.sapo_temperature_pos must be finite and > 0, "
                                          "got -1"),
            std::string::npos) << r.status.error_message();
  // Sequence-level importance sampling travels to the engine, which hears the fake backend
  // lacks it (kAllKinds has no kPolicySequenceBit).
  h = Header(v1::LOSS_KIND_POLICY);
  *h.mutable_advantages() = F32Rows();
  h.mutable_policy()->set_importance_sampling(v1::IMPORTANCE_SAMPLING_SEQUENCE);
  parts = Parts();
  AddParts(&parts, v1::TENSOR_ADVANTAGES, a_.data(), a_.size() * 4);
  r = RunCompute(h_.stub(), h, parts);
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::UNIMPLEMENTED);
  EXPECT_NE(r.status.error_message().find("does not compute header.policy.importance_sampling "
                                          "IMPORTANCE_SAMPLING_SEQUENCE"),
            std::string::npos) << r.status.error_message();
  // So does is_ratio (no kPolicyIsRatioBit either).
  h = Header(v1::LOSS_KIND_POLICY);
  *h.mutable_advantages() = F32Rows();
  *h.mutable_is_ratio() = F32Rows();
  parts = Parts();
  AddParts(&parts, v1::TENSOR_ADVANTAGES, a_.data(), a_.size() * 4);
  AddParts(&parts, v1::TENSOR_IS_RATIO, b_.data(), b_.size() * 4);
  r = RunCompute(h_.stub(), h, parts);
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::UNIMPLEMENTED);
  EXPECT_NE(r.status.error_message().find("does not compute header.is_ratio"),
            std::string::npos) << r.status.error_message();
  // verl's menu reaches the engine from the wire: the KL estimator (the first the fake
  // backend lacks), then gpg.
  h = Header(v1::LOSS_KIND_POLICY);
  *h.mutable_advantages() = F32Rows();
  h.mutable_policy()->set_kl_estimator(v1::KL_ESTIMATOR_ABS);
  h.mutable_policy()->set_entropy_coeff(0.5f);
  h.mutable_policy()->set_aggregation(v1::AGGREGATION_SEQ_MEAN_TOKEN_SUM_NORM);
  h.mutable_policy()->set_loss_scale_factor(3);
  parts = Parts();
  AddParts(&parts, v1::TENSOR_ADVANTAGES, a_.data(), a_.size() * 4);
  r = RunCompute(h_.stub(), h, parts);
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::UNIMPLEMENTED);
  EXPECT_NE(r.status.error_message().find("does not compute header.policy.kl_estimator abs "
                                          "(ServerInfo.features lists policy_kl_estimator"),
            std::string::npos) << r.status.error_message();
  h = Header(v1::LOSS_KIND_POLICY);
  *h.mutable_advantages() = F32Rows();
  h.mutable_policy()->set_loss_type(v1::POLICY_LOSS_GPG);
  r = RunCompute(h_.stub(), h, parts);
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::UNIMPLEMENTED);
  EXPECT_NE(r.status.error_message().find("does not compute header.policy.loss_type gpg"),
            std::string::npos) << r.status.error_message();
  h.mutable_policy()->set_loss_type(v1::POLICY_LOSS_GEO_MEAN);
  r = RunCompute(h_.stub(), h, parts);
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::UNIMPLEMENTED);
  EXPECT_NE(r.status.error_message().find("does not compute header.policy.loss_type geo_mean"),
            std::string::npos) << r.status.error_message();
  h.mutable_policy()->set_loss_type(v1::POLICY_LOSS_KL_COV);
  r = RunCompute(h_.stub(), h, parts);
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::UNIMPLEMENTED);
  EXPECT_NE(r.status.error_message().find("does not compute header.policy.loss_type kl_cov"),
            std::string::npos) << r.status.error_message();
  h.mutable_policy()->set_loss_type(v1::POLICY_LOSS_VESPO);
  r = RunCompute(h_.stub(), h, parts);
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::UNIMPLEMENTED);
  EXPECT_NE(r.status.error_message().find("does not compute header.policy.loss_type vespo"),
            std::string::npos) << r.status.error_message();
  h.mutable_policy()->set_loss_type(v1::POLICY_LOSS_CISPO_CLAMP);
  r = RunCompute(h_.stub(), h, parts);
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::UNIMPLEMENTED);
  EXPECT_NE(r.status.error_message().find("does not compute header.policy.loss_type cispo_clamp"),
            std::string::npos) << r.status.error_message();
  // Outputs of another kind.
  h = Header(v1::LOSS_KIND_DISTILL);
  h.mutable_outputs()->set_predictions(true);
  r = RunCompute(h_.stub(), h, Parts());
  EXPECT_EQ(r.status.error_message(),
            "header.outputs.predictions is for kind cross_entropy; this request's kind is "
            "distill");
}

// A backend that computes cross-entropy alone: every other kind is UNIMPLEMENTED on the wire,
// naming the backend, and ServerInfo lists no loss_kind feature.
TEST(LossKindsCrossEntropyOnlyTest, TheOtherKindsAreUnimplementedNamingTheBackend) {
  HarnessOptions o;
  o.backend = [] {
    return std::make_unique<KindsBackend>(LossKindBit(LossKind::kCrossEntropy),
                                          std::make_shared<KindsSeen>());
  };
  Harness h(o);
  RandomProblem rp = RandomProblem::Make(ShapeSpec(kBt, kH, kV));
  for (v1::LossKind kind : {v1::LOSS_KIND_LOGPROB, v1::LOSS_KIND_POLICY, v1::LOSS_KIND_DISTILL}) {
    v1::ComputeHeader header = HeaderFor(rp);
    header.set_kind(kind);
    ComputeReply r = RunCompute(h.stub(), header, PartsFor(rp, 4096));
    EXPECT_EQ(r.status.error_code(), grpc::StatusCode::UNIMPLEMENTED);
    EXPECT_EQ(r.status.error_message(),
              std::string("this server's backend 'kinds-fake' does not compute kind ") +
                  LossKindName(static_cast<LossKind>(kind)) +
                  " (it computes: cross_entropy; ServerInfo.features lists loss_kind_<name> "
                  "for each)");
  }
  // Cross-entropy itself is computed.
  ComputeReply ce = RunCompute(h.stub(), HeaderFor(rp), PartsFor(rp, 4096));
  EXPECT_TRUE(ce.status.ok()) << ce.status.error_message();
  grpc::ClientContext ctx;
  v1::ServerInfoResponse info;
  ASSERT_TRUE(h.stub().ServerInfo(&ctx, v1::ServerInfoRequest(), &info).ok());
  for (const std::string& f : info.features()) {
    EXPECT_EQ(f.rfind("loss_kind_", 0), std::string::npos) << f;
  }
}

}  // namespace
}  // namespace testing_harness
}  // namespace lossd
