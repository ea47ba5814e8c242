// SPDX-License-Identifier: Apache-2.0
// The C++ client's loss kinds end to end against the real server (engine + CPU backend, gRPC
// on loopback, in the test process), checked against the float64 references
// (kernels/cpu/*_reference.h) in fp32: logprob with upstream gradients and entropy, policy
// through a weight handle and into an accumulator, distill with the teacher's head by handle
// and from the teacher's top-k (ComputeRequest::teacher_topk_ids / _logp).
// Skipped where the server's backend does not list the kind.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/lossd_client.h"
#include "core/dtype.h"
#include "gtest/gtest.h"
#include "kernels/cpu/distill_reference.h"
#include "kernels/cpu/logprob_reference.h"
#include "kernels/cpu/policy_reference.h"
#include "testing/server_harness.h"

namespace lossd {
namespace client {
namespace {

using testing_harness::Harness;

constexpr int64_t kBT = 14, kH = 12, kV = 37, kHt = 9;  // two sequences of 7 for policy
// fp32 arithmetic against float64: |got - want| <= kRel |want| + kAbs max|want|.
constexpr double kRel = 1e-4, kAbs = 2e-5;

HostTensor Floats(std::vector<int64_t> shape, uint32_t seed, float scale) {
  HostTensor t = HostTensor::Owned(DType::kF32, std::move(shape));
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> u(-scale, scale);
  for (int64_t i = 0; i < t.num_elements(); ++i) t.mutable_data_as<float>()[i] = u(gen);
  return t;
}

HostTensor Targets(uint32_t seed, std::vector<int64_t> ignored) {
  HostTensor t = HostTensor::Owned(DType::kI64, {kBT});
  std::mt19937 gen(seed);
  for (int64_t i = 0; i < kBT; ++i) t.mutable_data_as<int64_t>()[i] = gen() % kV;
  for (int64_t i : ignored) t.mutable_data_as<int64_t>()[i] = kDefaultIgnoreIndex;
  return t;
}

HeadInputs Head(const HostTensor& x, const HostTensor& w, const HostTensor* bias) {
  return HeadInputs{x.dim(0), x.dim(1), w.dim(0), DType::kF32, x.data(), w.data(),
                    bias == nullptr ? nullptr : bias->data()};
}

void ExpectClose(const char* name, const float* got, const std::vector<double>& want) {
  double scale = 0;
  for (double v : want) scale = std::max(scale, std::fabs(v));
  ASSERT_GT(scale, 0) << name << ": an all-zero reference checks nothing";
  for (size_t i = 0; i < want.size(); ++i) {
    ASSERT_LE(std::fabs(got[i] - want[i]), kRel * std::fabs(want[i]) + kAbs * scale)
        << name << "[" << i << "]: got " << got[i] << ", want " << want[i];
  }
}

void ExpectOutput(const char* name, const ComputeResult& res, OutputTensor t,
                  const std::vector<double>& want) {
  const HostTensor* got = res.Find(t);
  ASSERT_NE(got, nullptr) << name << " was not returned";
  ASSERT_EQ(got->num_elements(), static_cast<int64_t>(want.size())) << name;
  ExpectClose(name, got->data_as<float>(), want);
}

class KindsE2eTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ClientOptions o;
    o.target = absl::StrCat("127.0.0.1:", harness_.port());
    o.deadline = absl::Seconds(60);
    o.part_bytes = 1000;  // every tensor travels as several parts
    auto c = LossClient::Create(o);
    ASSERT_TRUE(c.ok()) << c.status();
    client_ = std::move(*c);
  }

  // Skips the test where the server does not compute `kind`.
  bool Computes(LossKind kind) {
    absl::StatusOr<ServerInfoResult> info = client_->ServerInfo();
    EXPECT_TRUE(info.ok()) << info.status();
    const std::string feature = absl::StrCat("loss_kind_", LossKindName(kind));
    for (const std::string& f : info.ok() ? info->features : std::vector<std::string>{}) {
      if (f == feature) return true;
    }
    return false;
  }

  Harness harness_;
  std::unique_ptr<LossClient> client_;
};

TEST_F(KindsE2eTest, LogprobWithUpstreamGradientsAndEntropy) {
  if (!Computes(LossKind::kLogprob)) GTEST_SKIP() << "no loss_kind_logprob";
  ComputeRequest r;
  r.kind = LossKind::kLogprob;
  r.x = Floats({kBT, kH}, 1, 1.0f);
  r.w = Floats({kV, kH}, 2, 0.8f);
  r.bias = Floats({kV}, 3, 0.5f);
  r.targets = Targets(4, {2, 9});
  r.dlogp = Floats({kBT}, 5, 1.0f);
  r.dentropy = Floats({kBT}, 6, 1.0f);
  r.options.temperature = 0.8f;
  r.want.db = true;
  r.want.entropy = true;
  absl::StatusOr<ComputeResult> res = client_->Compute(r);
  ASSERT_TRUE(res.ok()) << res.status();

  LogprobProblem p;
  p.head = Head(r.x, *r.w, &*r.bias);
  p.targets = r.targets.data();
  p.dlogp = r.dlogp->data_as<float>();
  p.dentropy = r.dentropy->data_as<float>();
  p.options.temperature = 0.8f;
  LogprobReferenceOutputs want;
  ASSERT_TRUE(LogprobReference(p, &want).ok());
  ExpectOutput("logp", *res, OutputTensor::kLogp, want.logp);
  ExpectOutput("entropy", *res, OutputTensor::kEntropy, want.entropy);
  ExpectOutput("dx", *res, OutputTensor::kDx, want.grad.dx);
  ExpectOutput("dw", *res, OutputTensor::kDw, want.grad.dw);
  ExpectOutput("db", *res, OutputTensor::kDb, want.grad.db);
  EXPECT_EQ(res->tokens, kBT - 2);
}

// The two-phase log-prob through the client: the forward keeps a ticket and returns logp and
// entropy; the backward gives only dlogp and dentropy and gets what the one-phase call gets,
// bit for bit (and the reference's values); once consumed the ticket is NOT_FOUND.
TEST_F(KindsE2eTest, TwoPhaseLogprobIsTheOnePhaseCallBitForBit) {
  if (!Computes(LossKind::kLogprob)) GTEST_SKIP() << "no loss_kind_logprob";
  ComputeRequest one;
  one.kind = LossKind::kLogprob;
  one.x = Floats({kBT, kH}, 11, 1.0f);
  one.w = Floats({kV, kH}, 12, 0.8f);
  one.bias = Floats({kV}, 13, 0.5f);
  one.targets = Targets(14, {1, 8});
  one.options.temperature = 0.7f;
  one.options.softcap = 5.0f;
  one.options.grad_scale = 0.5f;
  one.want.db = true;
  one.want.entropy = true;
  one.dlogp = Floats({kBT}, 15, 1.0f);
  one.dentropy = Floats({kBT}, 16, 1.0f);

  ComputeRequest fwd;
  fwd.kind = LossKind::kLogprob;
  fwd.x = HostTensor::View(one.x.dtype(), one.x.shape(), one.x.data());
  fwd.w = HostTensor::View(one.w->dtype(), one.w->shape(), one.w->data());
  fwd.bias = HostTensor::View(one.bias->dtype(), one.bias->shape(), one.bias->data());
  fwd.targets = HostTensor::View(one.targets.dtype(), one.targets.shape(), one.targets.data());
  fwd.options = one.options;
  fwd.want = WantedOutputs{};
  fwd.want.dx = fwd.want.dw = false;
  fwd.want.entropy = true;
  fwd.keep_ms = 60000;
  absl::StatusOr<ComputeResult> kept = client_->Compute(fwd);
  ASSERT_TRUE(kept.ok()) << kept.status();
  ASSERT_FALSE(kept->ticket.empty());
  EXPECT_GT(kept->ticket_expires_unix_ms, absl::ToUnixMillis(absl::Now()));
  EXPECT_EQ(kept->Find(OutputTensor::kDx), nullptr);
  absl::StatusOr<std::vector<StateEntry>> listed = client_->List();
  ASSERT_TRUE(listed.ok()) << listed.status();
  ASSERT_EQ(listed->size(), 1u);
  EXPECT_EQ((*listed)[0].kind, StateEntry::Kind::kTicket);
  EXPECT_EQ((*listed)[0].name, kept->ticket);

  ComputeRequest back;
  back.kind = LossKind::kLogprob;
  back.ticket = kept->ticket;
  back.dlogp = HostTensor::View(DType::kF32, {kBT}, one.dlogp->data());
  back.dentropy = HostTensor::View(DType::kF32, {kBT}, one.dentropy->data());
  back.options.grad_scale = 0.5f;
  back.want.db = true;
  back.want.entropy = true;
  // What the ticket holds is refused before anything is sent.
  ComputeRequest with_x = back;
  with_x.x = HostTensor::View(one.x.dtype(), one.x.shape(), one.x.data());
  absl::StatusOr<ComputeResult> refused = client_->Compute(with_x);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("gives x: a backward gives only dlogp"),
            std::string::npos)
      << refused.status();

  absl::StatusOr<ComputeResult> b = client_->Compute(back);
  ASSERT_TRUE(b.ok()) << b.status();
  absl::StatusOr<ComputeResult> o = client_->Compute(one);
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(b->loss, o->loss);
  for (OutputTensor t : {OutputTensor::kLogp, OutputTensor::kEntropy, OutputTensor::kDx,
                         OutputTensor::kDw, OutputTensor::kDb}) {
    const HostTensor* got = b->Find(t);
    const HostTensor* want = o->Find(t);
    ASSERT_NE(got, nullptr) << OutputTensorName(t);
    ASSERT_NE(want, nullptr) << OutputTensorName(t);
    ASSERT_EQ(got->num_bytes(), want->num_bytes()) << OutputTensorName(t);
    EXPECT_EQ(std::memcmp(got->data(), want->data(), got->num_bytes()), 0)
        << OutputTensorName(t);
  }
  for (OutputTensor t : {OutputTensor::kLogp, OutputTensor::kEntropy}) {
    ASSERT_NE(kept->Find(t), nullptr);
    EXPECT_EQ(std::memcmp(kept->Find(t)->data(), o->Find(t)->data(), kBT * 4), 0);
  }
  // And the values are the reference's.
  LogprobProblem p;
  p.head = Head(one.x, *one.w, &*one.bias);
  p.targets = one.targets.data();
  p.dlogp = one.dlogp->data_as<float>();
  p.dentropy = one.dentropy->data_as<float>();
  p.options.temperature = 0.7f;
  p.options.softcap = 5.0f;
  LogprobReferenceOutputs want;
  ASSERT_TRUE(LogprobReference(p, &want).ok());
  // The reference's gradients are of F at grad_scale 1; the calls' at 0.5 (exact in fp32).
  for (std::vector<double>* g : {&want.grad.dx, &want.grad.dw, &want.grad.db}) {
    for (double& v : *g) v *= 0.5;
  }
  ExpectOutput("dx", *b, OutputTensor::kDx, want.grad.dx);
  ExpectOutput("dw", *b, OutputTensor::kDw, want.grad.dw);
  ExpectOutput("db", *b, OutputTensor::kDb, want.grad.db);

  absl::StatusOr<ComputeResult> again = client_->Compute(back);
  EXPECT_EQ(again.status().code(), absl::StatusCode::kNotFound) << again.status();
  EXPECT_NE(again.status().message().find("resend X"), std::string::npos) << again.status();
}

// Policy inputs, and the reference problem of the same call.
struct PolicyCase {
  ComputeRequest r;
  PolicyProblem p;
  std::vector<uint8_t> mask;
};

// `luspo`: loss type luspo with delta 1.4 and the bias-corrected KL, else grpo.
void MakePolicy(uint32_t seed, const HostTensor& w, bool luspo, PolicyCase* c) {
  ComputeRequest& r = c->r;
  r.kind = LossKind::kPolicy;
  r.x = Floats({kBT, kH}, seed, 1.0f);
  r.targets = Targets(seed + 1, {3, 12});
  r.advantages = Floats({kBT}, seed + 2, 1.0f);
  r.old_logp = HostTensor::Owned(DType::kF32, {kBT});
  r.ref_logp = HostTensor::Owned(DType::kF32, {kBT});
  r.policy.loss_type = PolicyLossType::kGrpo;
  r.policy.epsilon_high = 0.28f;
  r.policy.beta = 0.1f;
  r.policy.sequences = 2;
  if (luspo) {
    r.policy.loss_type = PolicyLossType::kLuspo;
    r.policy.delta = 1.4f;
    r.policy.use_bias_correction_kl = true;
  }
  r.options.temperature = 1.1f;
  r.want.dw = false;
  // Old and reference log-probs near the current ones (ratios in (0.6, 1.5), some clipped),
  // from the reference's own log-probs.
  c->mask.assign(kBT, 1);
  c->mask[3] = c->mask[12] = 0;
  PolicyProblem& p = c->p;
  p.head = Head(r.x, w, nullptr);
  p.batch = 2;
  p.targets = r.targets.data();
  p.mask = c->mask.data();
  p.advantages = r.advantages->data_as<float>();
  p.options.loss_type = PolicyLossType::kGrpo;
  p.options.epsilon_high = 0.28f;
  p.options.beta = 0.1f;
  p.options.temperature = 1.1f;
  p.options.loss_type = r.policy.loss_type;
  p.options.delta = r.policy.delta;
  p.options.use_bias_correction_kl = r.policy.use_bias_correction_kl;
  PolicyReferenceOutputs cur;
  ASSERT_TRUE(PolicyReference(p, &cur).ok());
  std::mt19937 gen(seed + 3);
  std::uniform_real_distribution<float> ratio(0.6f, 1.5f), shift(-0.3f, 0.3f);
  for (int64_t i = 0; i < kBT; ++i) {
    float q = ratio(gen);
    for (float bound : {0.8f, 1.28f, 1.4f}) {  // off the clip bounds and delta
      if (std::fabs(q - bound) < 0.03f) q += 0.07f;
    }
    r.old_logp->mutable_data_as<float>()[i] = static_cast<float>(cur.logp[i]) - std::log(q);
    r.ref_logp->mutable_data_as<float>()[i] = static_cast<float>(cur.logp[i]) + shift(gen);
  }
  p.old_logp = r.old_logp->data_as<float>();
  p.ref_logp = r.ref_logp->data_as<float>();
}

TEST_F(KindsE2eTest, PolicyThroughAWeightHandleAndIntoAnAccumulator) {
  if (!Computes(LossKind::kPolicy)) GTEST_SKIP() << "no loss_kind_policy";
  const HostTensor w = Floats({kV, kH}, 10, 0.8f);
  absl::StatusOr<PutWeightsResult> put = client_->PutWeights(w, nullptr);
  ASSERT_TRUE(put.ok()) << put.status();
  std::vector<double> dw_sum(kV * kH, 0.0);
  for (uint32_t mb = 0; mb < 2; ++mb) {
    PolicyCase c;
    MakePolicy(20 + 10 * mb, w, /*luspo=*/mb == 1, &c);  // two loss types, one accumulator
    c.r.weight_handle = put->handle;
    c.r.accumulator = "policy-acc";
    absl::StatusOr<ComputeResult> res = client_->Compute(c.r);
    ASSERT_TRUE(res.ok()) << res.status();
    PolicyReferenceOutputs want;
    ASSERT_TRUE(PolicyReference(c.p, &want).ok());
    ASSERT_TRUE(want.has_kl);
    EXPECT_NEAR(res->loss, want.loss, kRel * std::fabs(want.loss) + 1e-6);
    EXPECT_NEAR(res->kl, want.kl, kRel * std::fabs(want.kl) + 1e-6);
    EXPECT_NEAR(res->clip_fraction, want.clip_fraction, 1e-6);
    EXPECT_GT(want.clip_fraction, 0.0) << "some tokens clip";
    ExpectOutput("dx", *res, OutputTensor::kDx, want.grad.dx);
    EXPECT_EQ(res->Find(OutputTensor::kDw), nullptr);  // into the accumulator
    for (size_t i = 0; i < dw_sum.size(); ++i) dw_sum[i] += want.grad.dw[i];
  }
  absl::StatusOr<FetchGradientsResult> g = client_->FetchGradients("policy-acc", true);
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(g->micro_batches, 2u);
  ExpectClose("accumulated dw", g->dw.data_as<float>(), dw_sum);
}

TEST_F(KindsE2eTest, DistillWithTheTeacherByHandle) {
  if (!Computes(LossKind::kDistill)) GTEST_SKIP() << "no loss_kind_distill";
  const HostTensor tw = Floats({kV, kHt}, 40, 0.8f), tb = Floats({kV}, 41, 0.5f);
  absl::StatusOr<PutWeightsResult> put = client_->PutWeights(tw, &tb);
  ASSERT_TRUE(put.ok()) << put.status();
  for (float jsd_beta : {0.0f, 0.3f, 1.0f}) {
    SCOPED_TRACE(jsd_beta);
    ComputeRequest r;
    r.kind = LossKind::kDistill;
    r.x = Floats({kBT, kH}, 42, 1.0f);
    r.w = Floats({kV, kH}, 43, 0.8f);
    r.targets = Targets(44, {0, 5, 6});
    r.teacher_x = Floats({kBT, kHt}, 45, 1.0f);
    r.teacher_weight_handle = put->handle;
    r.distill.jsd_beta = jsd_beta;
    r.options.temperature = 1.5f;
    absl::StatusOr<ComputeResult> res = client_->Compute(r);
    ASSERT_TRUE(res.ok()) << res.status();
    DistillProblem p;
    p.student = Head(r.x, *r.w, nullptr);
    p.teacher = Head(*r.teacher_x, tw, &tb);
    p.labels = r.targets.data();
    p.options.jsd_beta = jsd_beta;
    p.options.temperature = 1.5f;
    DistillReferenceOutputs want;
    ASSERT_TRUE(DistillReference(p, &want).ok());
    EXPECT_NEAR(res->loss, want.loss, kRel * std::fabs(want.loss) + 1e-6);
    ExpectOutput("dx", *res, OutputTensor::kDx, want.grad.dx);
    ExpectOutput("dw", *res, OutputTensor::kDw, want.grad.dw);
  }
}

// A teacher's top-k per row (no teacher head): the k most likely ids of random logits over V,
// in an order turned per row, and their log-probs, fp32; the ids as int32 or int64.
struct TopkTeacher {
  static constexpr int64_t kK = 4;
  TopkTeacher(uint32_t seed, DType id_dtype)
      : ids(HostTensor::Owned(id_dtype, {kBT, kK})),
        logp(HostTensor::Owned(DType::kF32, {kBT, kK})) {
    const HostTensor z = Floats({kBT, kV}, seed, 3.0f);
    std::vector<int64_t> order(kV);
    for (int64_t i = 0; i < kBT; ++i) {
      const float* zi = z.data_as<float>() + i * kV;
      double m = -INFINITY, sum = 0;
      for (int64_t j = 0; j < kV; ++j) m = std::max(m, static_cast<double>(zi[j]));
      for (int64_t j = 0; j < kV; ++j) sum += std::exp(zi[j] - m);
      for (int64_t j = 0; j < kV; ++j) order[j] = j;
      std::partial_sort(order.begin(), order.begin() + kK, order.end(),
                        [&](int64_t a, int64_t b) { return zi[a] > zi[b]; });
      std::rotate(order.begin(), order.begin() + i % kK, order.begin() + kK);
      for (int64_t a = 0; a < kK; ++a) {
        if (id_dtype == DType::kI32) {
          ids.mutable_data_as<int32_t>()[i * kK + a] = static_cast<int32_t>(order[a]);
        } else {
          ids.mutable_data_as<int64_t>()[i * kK + a] = order[a];
        }
        logp.mutable_data_as<float>()[i * kK + a] =
            static_cast<float>(zi[order[a]] - m - std::log(sum));
      }
    }
  }
  HostTensor ids, logp;
};

TEST_F(KindsE2eTest, DistillFromTheTeachersTopk) {
  absl::StatusOr<ServerInfoResult> info = client_->ServerInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  if (std::find(info->features.begin(), info->features.end(), "distill_topk") ==
      info->features.end()) {
    GTEST_SKIP() << "no distill_topk";
  }
  struct Case {
    DistillTopkTail tail;
    float jsd_beta;
    DType id_dtype;
  };
  for (const Case& c : {Case{DistillTopkTail::kBucket, 0.0f, DType::kI64},
                        Case{DistillTopkTail::kBucket, 1.0f, DType::kI32},
                        Case{DistillTopkTail::kRenormalize, 0.5f, DType::kI64},
                        Case{DistillTopkTail::kNone, 0.0f, DType::kI32}}) {
    SCOPED_TRACE(absl::StrCat(DistillTopkTailName(c.tail), " jsd_beta ", c.jsd_beta));
    const TopkTeacher t(50, c.id_dtype);
    ComputeRequest r;
    r.kind = LossKind::kDistill;
    r.x = Floats({kBT, kH}, 51, 1.0f);
    r.w = Floats({kV, kH}, 52, 0.8f);
    r.bias = Floats({kV}, 53, 0.5f);
    r.want.db = true;
    r.targets = Targets(54, {1, 8});
    r.teacher_topk_ids = t.ids;
    r.teacher_topk_logp = t.logp;
    r.distill.jsd_beta = c.jsd_beta;
    r.distill.topk_tail = c.tail;
    r.options.temperature = 1.3f;
    absl::StatusOr<ComputeResult> res = client_->Compute(r);
    ASSERT_TRUE(res.ok()) << res.status();
    DistillProblem p;
    p.student = Head(r.x, *r.w, &*r.bias);
    p.topk = TopkTeacher::kK;
    p.topk_ids = t.ids.data();
    p.topk_id_dtype = c.id_dtype;
    p.topk_logp = t.logp.data_as<float>();
    p.labels = r.targets.data();
    p.options.jsd_beta = c.jsd_beta;
    p.options.temperature = 1.3f;
    p.options.topk_tail = c.tail;
    DistillReferenceOutputs want;
    ASSERT_TRUE(DistillReference(p, &want).ok());
    EXPECT_GT(want.loss, 0.0);
    EXPECT_NEAR(res->loss, want.loss, kRel * std::fabs(want.loss) + 1e-6);
    ExpectOutput("dx", *res, OutputTensor::kDx, want.grad.dx);
    ExpectOutput("dw", *res, OutputTensor::kDw, want.grad.dw);
    ExpectOutput("db", *res, OutputTensor::kDb, want.grad.db);
  }
}

}  // namespace
}  // namespace client
}  // namespace lossd
