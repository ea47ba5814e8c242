// SPDX-License-Identifier: Apache-2.0
// The loss kinds end to end: a real server over the CPU backend, requests on the wire, and
// every output compared with the float64 references (kernels/cpu/*_reference.h): logprob's
// logp, entropy, loss and gradients, and policy's loss, metrics and gradients over every
// loss type, with a weight handle and an accumulator. fp32 inputs, so the tolerance is the
// backend's fp32 arithmetic alone. Each kind is skipped while the CPU backend lacks it.
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/cpu/distill_reference.h"
#include "kernels/cpu/logprob_reference.h"
#include "kernels/cpu/policy_reference.h"
#include "lossd/v1/lossd.grpc.pb.h"
#include "testing/server_harness.h"
#include "testing/test_util.h"

namespace lossd {
namespace testing_harness {
namespace {

constexpr int64_t kBt = 24, kH = 16, kV = 40;
constexpr size_t kPartBytes = 1000;
constexpr double kTol = 2e-4;  // fp32 arithmetic against float64, relative

std::vector<float> Uniform(int64_t n, float lo, float hi, uint64_t seed) {
  std::mt19937_64 g(seed);
  std::uniform_real_distribution<float> u(lo, hi);
  std::vector<float> r(n);
  for (float& f : r) f = u(g);
  return r;
}

v1::TensorSpec F32Rows() {
  v1::TensorSpec s;
  s.set_dtype(v1::DTYPE_FP32);
  s.add_shape(kBt);
  return s;
}

void AddRows(std::vector<v1::ComputeRequest>* out, v1::TensorId id,
             const std::vector<float>& rows) {
  v1::ComputeRequest r;
  r.mutable_part()->set_tensor(id);
  r.mutable_part()->set_data(rows.data(), rows.size() * 4);
  out->push_back(std::move(r));
}

std::vector<float> Floats(const std::vector<uint8_t>& bytes) {
  std::vector<float> f(bytes.size() / 4);
  std::memcpy(f.data(), bytes.data(), f.size() * 4);
  return f;
}

// |got - want| / max(|want|, floor) over the whole vector by norms: the relative error of a
// gradient (floor keeps an all-but-zero reference from dividing by nothing).
double RelNormError(const std::vector<float>& got, const std::vector<double>& want) {
  EXPECT_EQ(got.size(), want.size());
  double d = 0, n = 0;
  for (size_t i = 0; i < got.size() && i < want.size(); ++i) {
    EXPECT_TRUE(std::isfinite(got[i])) << i;
    d += (got[i] - want[i]) * (got[i] - want[i]);
    n += want[i] * want[i];
  }
  return std::sqrt(d) / std::max(std::sqrt(n), 1e-6);
}

void ExpectNear(double got, double want, const std::string& what) {
  EXPECT_NEAR(got, want, kTol * (1 + std::abs(want))) << what;
}

// Policy's options of one case, on the wire and in the reference.
struct PolicyCase {
  v1::PolicyLossType wire;
  PolicyLossType type;
  float beta;
  bool old, ref;
  float epsilon_high = 0.28f, delta = 0.0f;  // delta 0: unset
  bool bias_correction = false;
};

class LossKindsE2eTest : public SuiteHarness<LossKindsE2eTest> {
 protected:
  LossKindsE2eTest() : rp_(Make()) {}
  static RandomProblem Make() {
    RandomProblemSpec s = ShapeSpec(kBt, kH, kV, DType::kF32);
    s.bias = true;
    s.ignore_fraction = 0.2;
    s.seed = 77;
    return RandomProblem::Make(s);
  }
  bool Served(LossKind k) const {
    return (h_->engine().backend_info().loss_kinds & LossKindBit(k)) != 0;
  }
  HeadInputs Head() const {
    const LossProblem p = rp_.problem();
    return HeadInputs{p.bt, p.h, p.v, p.dtype, p.x, p.w, p.bias};
  }
  // The header of `kind` with dx (and, inline, dw and db) wanted.
  v1::ComputeHeader Header(v1::LossKind kind, const std::string& handle = "") const {
    v1::ComputeHeader h = HeaderFor(rp_, handle);
    h.set_kind(kind);
    h.clear_outputs();
    h.mutable_outputs()->set_dx(true);
    h.mutable_outputs()->set_dw(handle.empty());
    h.mutable_outputs()->set_db(handle.empty());
    return h;
  }
  // The header of policy case `c` over the student's W by `handle`, into accumulator `acc`.
  v1::ComputeHeader PolicyHeader(const PolicyCase& c, const std::string& handle,
                                 const std::string& acc) const {
    v1::ComputeHeader h = Header(v1::LOSS_KIND_POLICY, handle);
    h.set_accumulator(acc);
    *h.mutable_advantages() = F32Rows();
    if (c.old) *h.mutable_old_logp() = F32Rows();
    if (c.ref) *h.mutable_ref_logp() = F32Rows();
    v1::PolicyOptions* o = h.mutable_policy();
    o->set_loss_type(c.wire);
    o->set_beta(c.beta);
    o->set_epsilon_high(c.epsilon_high);
    o->set_sapo_temperature_pos(1.7f);
    o->set_sapo_temperature_neg(0.6f);
    if (c.delta != 0.0f) o->set_delta(c.delta);
    o->set_use_bias_correction_kl(c.bias_correction);
    o->set_sequences(3);
    o->set_max_completion_length(10);
    h.mutable_options()->set_temperature(0.9f);
    h.mutable_options()->set_grad_scale(0.75f);
    return h;
  }

  // The float64 reference of the same case.
  absl::Status PolicyRef(const PolicyCase& c, const std::vector<float>& adv,
                         const std::vector<float>& old_logp, const std::vector<float>& ref_logp,
                         const std::vector<uint8_t>& mask, PolicyReferenceOutputs* ref) const {
    PolicyProblem pp;
    pp.head = Head();
    pp.batch = 3;
    pp.targets = rp_.targets.data();
    pp.mask = mask.data();
    pp.advantages = adv.data();
    pp.old_logp = c.old ? old_logp.data() : nullptr;
    pp.ref_logp = c.ref ? ref_logp.data() : nullptr;
    pp.options.loss_type = c.type;
    pp.options.beta = c.beta;
    pp.options.epsilon_high = c.epsilon_high;
    pp.options.sapo_temperature_pos = 1.7f;
    pp.options.sapo_temperature_neg = 0.6f;
    pp.options.delta = c.delta;
    pp.options.use_bias_correction_kl = c.bias_correction;
    pp.options.temperature = 0.9f;
    pp.options.max_completion_length = 10;
    pp.options.grad_scale = 0.75f;
    return PolicyReference(pp, ref);
  }
  RandomProblem rp_;
};

// logprob's outputs in `r` against the reference: logp, entropy, the loss and gradients.
void ExpectLogprobMatches(ComputeReply& r, const LogprobReferenceOutputs& ref,
                          const std::vector<float>& dlogp, const std::vector<float>& dentropy,
                          float grad_scale) {
  const std::vector<float> logp = Floats(r.tensors[v1::TENSOR_LOGP]);
  const std::vector<float> entropy = Floats(r.tensors[v1::TENSOR_ENTROPY]);
  const std::vector<float> lse = Floats(r.tensors[v1::TENSOR_LSE]);
  ASSERT_EQ(logp.size(), static_cast<size_t>(kBt));
  ASSERT_EQ(entropy.size(), static_cast<size_t>(kBt));
  ASSERT_EQ(lse.size(), static_cast<size_t>(kBt));
  double f = 0;
  for (int64_t i = 0; i < kBt; ++i) {
    ExpectNear(logp[i], ref.logp[i], absl::StrCat("logp[", i, "]"));
    ExpectNear(lse[i], ref.lse[i], absl::StrCat("lse[", i, "] (at the temperature)"));
    ExpectNear(entropy[i], ref.entropy[i], absl::StrCat("entropy[", i, "]"));
    f += dlogp[i] * ref.logp[i] + dentropy[i] * ref.entropy[i];
  }
  ExpectNear(r.summary.loss(), grad_scale * f, "loss = grad_scale sum(dlogp logp + dent H)");
  EXPECT_EQ(r.summary.tokens(), ref.tokens);
  const std::vector<double>* want[] = {&ref.grad.dx, &ref.grad.dw, &ref.grad.db};
  const v1::TensorId ids[] = {v1::TENSOR_DX, v1::TENSOR_DW, v1::TENSOR_DB};
  for (int k = 0; k < 3; ++k) {
    std::vector<double> scaled = *want[k];
    for (double& g : scaled) g *= grad_scale;
    EXPECT_LT(RelNormError(Floats(r.tensors[ids[k]]), scaled), kTol) << ids[k];
  }
}

TEST_F(LossKindsE2eTest, LogprobMatchesTheReference) {
  if (!Served(LossKind::kLogprob)) GTEST_SKIP() << "the CPU backend lacks logprob";
  const std::vector<float> dlogp = Uniform(kBt, -1.5f, 1.5f, 5);
  const std::vector<float> dentropy = Uniform(kBt, -1.0f, 1.0f, 6);
  const float temperature = 0.7f, softcap = 6.0f, grad_scale = 0.5f;
  v1::ComputeHeader h = Header(v1::LOSS_KIND_LOGPROB);
  *h.mutable_dlogp() = F32Rows();
  *h.mutable_dentropy() = F32Rows();
  h.mutable_outputs()->set_entropy(true);
  h.mutable_outputs()->set_lse(true);
  h.mutable_options()->set_temperature(temperature);
  h.mutable_options()->set_softcap(softcap);
  h.mutable_options()->set_grad_scale(grad_scale);
  std::vector<v1::ComputeRequest> parts = PartsFor(rp_, kPartBytes);
  AddRows(&parts, v1::TENSOR_DLOGP, dlogp);
  AddRows(&parts, v1::TENSOR_DENTROPY, dentropy);
  LogprobProblem lp;
  lp.head = Head();
  lp.targets = rp_.targets.data();
  lp.dlogp = dlogp.data();
  lp.dentropy = dentropy.data();
  lp.options.temperature = temperature;
  lp.options.softcap = softcap;
  LogprobReferenceOutputs ref;
  ASSERT_TRUE(LogprobReference(lp, &ref).ok());
  // Plain, and overlapped (X streams in while the backend computes, in chunks of 5 rows).
  for (bool overlap : {false, true}) {
    SCOPED_TRACE(overlap ? "overlapped" : "plain");
    h.set_overlap(overlap);
    h.mutable_options()->set_chunk_rows(overlap ? 5 : 0);
    ComputeReply r = RunCompute(h_->stub(), h, overlap ? XLast(parts) : parts);
    ASSERT_TRUE(r.status.ok()) << r.status.error_message();
    ExpectLogprobMatches(r, ref, dlogp, dentropy, grad_scale);
  }
}

// A hosted head's compute copy is the student: logprob on a head (fp32 master and copy, so
// the copy is W itself) matches the reference over W, and its gradient goes to the step.
TEST_F(LossKindsE2eTest, LogprobOnAHostedHeadMatchesTheReference) {
  if (!Served(LossKind::kLogprob)) GTEST_SKIP() << "the CPU backend lacks logprob";
  HeadSpec hs;
  hs.name = "e2e-head";
  hs.v = kV;
  hs.h = kH;
  hs.has_bias = true;
  hs.master_dtype = DType::kF32;
  hs.compute_dtype = DType::kF32;
  HeadStore& heads = h_->engine().heads();
  auto c = heads.BeginCreate(hs, "");
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_TRUE(heads.WriteCreate(*c->pending, HeadTensor::kMasterW, 0, rp_.w.data(), rp_.w.size())
                  .ok());
  ASSERT_TRUE(heads
                  .WriteCreate(*c->pending, HeadTensor::kMasterBias, 0, rp_.bias.data(),
                               rp_.bias.size())
                  .ok());
  ASSERT_TRUE(heads.CommitCreate(std::move(c->pending)).ok());
  const std::vector<float> dlogp = Uniform(kBt, -1.0f, 1.0f, 15);
  v1::ComputeHeader h = Header(v1::LOSS_KIND_LOGPROB);
  h.clear_w();
  h.clear_bias();
  h.mutable_outputs()->set_dw(false);
  h.mutable_outputs()->set_db(false);
  h.set_head("e2e-head");
  *h.mutable_dlogp() = F32Rows();
  std::vector<v1::ComputeRequest> parts = PartsFor(rp_, kPartBytes, false);
  AddRows(&parts, v1::TENSOR_DLOGP, dlogp);
  ComputeReply r = RunCompute(h_->stub(), h, parts);
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  EXPECT_TRUE(r.summary.head_added());
  LogprobProblem lp;
  lp.head = Head();
  lp.targets = rp_.targets.data();
  lp.dlogp = dlogp.data();
  LogprobReferenceOutputs ref;
  ASSERT_TRUE(LogprobReference(lp, &ref).ok());
  const std::vector<float> logp = Floats(r.tensors[v1::TENSOR_LOGP]);
  ASSERT_EQ(logp.size(), static_cast<size_t>(kBt));
  for (int64_t i = 0; i < kBt; ++i) ExpectNear(logp[i], ref.logp[i], absl::StrCat("logp ", i));
  EXPECT_LT(RelNormError(Floats(r.tensors[v1::TENSOR_DX]), ref.grad.dx), kTol);
  EXPECT_EQ(r.tensors.count(v1::TENSOR_DW), 0u);  // into the head's step
}


TEST_F(LossKindsE2eTest, PolicyMatchesTheReferenceOverEveryLossTypeByHandleIntoAnAccumulator) {
  if (!Served(LossKind::kPolicy)) GTEST_SKIP() << "the CPU backend lacks policy";
  std::string handle;
  ASSERT_TRUE(PutWeights(h_->stub(), rp_, kPartBytes, &handle).ok());
  // Old and reference log-probs near the current ones (the logprob reference's), so that
  // some ratios are clipped and some are not.
  LogprobProblem lp;
  lp.head = Head();
  lp.targets = rp_.targets.data();
  LogprobReferenceOutputs now;
  ASSERT_TRUE(LogprobReference(lp, &now).ok());
  const std::vector<float> adv = Uniform(kBt, -2.0f, 2.0f, 8);
  const std::vector<float> noise_old = Uniform(kBt, -0.4f, 0.4f, 9);
  const std::vector<float> noise_ref = Uniform(kBt, -0.5f, 0.5f, 10);
  std::vector<float> old_logp(kBt), ref_logp(kBt);
  std::vector<uint8_t> mask(kBt);
  for (int64_t i = 0; i < kBt; ++i) {
    old_logp[i] = static_cast<float>(now.logp[i]) + noise_old[i];
    ref_logp[i] = static_cast<float>(now.logp[i]) + noise_ref[i];
    mask[i] = rp_.targets[i] != kDefaultIgnoreIndex;
  }
  const PolicyCase cases[] = {
      {v1::POLICY_LOSS_DAPO, PolicyLossType::kDapo, 0.04f, true, true},
      {v1::POLICY_LOSS_GRPO, PolicyLossType::kGrpo, 0.1f, true, true},
      {v1::POLICY_LOSS_BNPO, PolicyLossType::kBnpo, 0.0f, true, false},
      {v1::POLICY_LOSS_DR_GRPO, PolicyLossType::kDrGrpo, 0.04f, false, true},
      // Ratios are in about [0.67, 1.49]: cispo's bound (eps_high itself, 1.2) and delta 1.35
      // fall among them.
      {v1::POLICY_LOSS_CISPO, PolicyLossType::kCispo, 0.04f, true, true, 1.2f},
      {v1::POLICY_LOSS_SAPO, PolicyLossType::kSapo, 0.1f, true, true, 0.28f, 0.0f, true},
      {v1::POLICY_LOSS_LUSPO, PolicyLossType::kLuspo, 0.04f, true, true, 0.28f, 1.35f, true},
  };
  int clipped_cases = 0;
  for (const PolicyCase& c : cases) {
    SCOPED_TRACE(PolicyLossTypeName(c.type));
    const std::string acc = absl::StrCat("policy-", PolicyLossTypeName(c.type), "-", c.delta);
    const v1::ComputeHeader h = PolicyHeader(c, handle, acc);
    std::vector<v1::ComputeRequest> parts = PartsFor(rp_, kPartBytes, false);
    AddRows(&parts, v1::TENSOR_ADVANTAGES, adv);
    if (c.old) AddRows(&parts, v1::TENSOR_OLD_LOGP, old_logp);
    if (c.ref) AddRows(&parts, v1::TENSOR_REF_LOGP, ref_logp);
    ComputeReply r = RunCompute(h_->stub(), h, parts);
    ASSERT_TRUE(r.status.ok()) << r.status.error_message();

    PolicyReferenceOutputs ref;
    ASSERT_TRUE(PolicyRef(c, adv, old_logp, ref_logp, mask, &ref).ok());
    ExpectNear(r.summary.loss(), ref.loss, "loss");
    ExpectNear(r.summary.kl(), ref.has_kl ? ref.kl : 0.0, "kl");
    ExpectNear(r.summary.clip_fraction(), ref.clip_fraction, "clip_fraction");
    clipped_cases += ref.clip_fraction > 0;
    if (c.beta != 0 && c.ref) EXPECT_GT(ref.kl, 0) << "a weak case: no KL to compare";
    EXPECT_EQ(r.summary.tokens(), ref.tokens);
    EXPECT_EQ(r.summary.accumulated_micro_batches(), 1u);
    EXPECT_LT(RelNormError(Floats(r.tensors[v1::TENSOR_DX]), ref.grad.dx), kTol);
    auto g = h_->engine().FetchGradients(acc, false);
    ASSERT_TRUE(g.ok()) << g.status();
    std::vector<float> dw(kV * kH), db(kV);
    std::memcpy(dw.data(), g->data.get(), dw.size() * 4);
    std::memcpy(db.data(), g->data.get() + dw.size() * 4, db.size() * 4);
    EXPECT_LT(RelNormError(dw, ref.grad.dw), kTol);
    EXPECT_LT(RelNormError(db, ref.grad.db), kTol);
  }
  EXPECT_GT(clipped_cases, 0) << "a weak test: no ratio was clipped";
}

// Distill's cases: the teacher by handle or inline (with or without its bias), with or
// without targets, plain or overlapped, over jsd_beta's two ends and the middle.
struct DistillCase {
  float jsd_beta;
  bool by_handle, teacher_bias, targets, overlap;
};

TEST_F(LossKindsE2eTest, DistillMatchesTheReferenceWithTheTeacherByHandleOrInline) {
  if (!Served(LossKind::kDistill)) GTEST_SKIP() << "the CPU backend lacks distill";
  constexpr int64_t kHt = 12;
  RandomProblemSpec ts = ShapeSpec(kBt, kHt, kV, DType::kF32);
  ts.bias = true;
  ts.seed = 78;
  const RandomProblem teacher = RandomProblem::Make(ts);
  std::string handle;
  ASSERT_TRUE(PutWeights(h_->stub(), teacher, kPartBytes, &handle).ok());
  const DistillCase cases[] = {{0.5f, true, true, true, false},
                               {0.0f, false, true, false, true},
                               {1.0f, false, false, true, true},
                               {0.25f, true, true, false, false}};
  const float temperature = 1.5f, grad_scale = 2.0f;
  for (const DistillCase& c : cases) {
    SCOPED_TRACE(absl::StrCat("jsd_beta ", c.jsd_beta, c.by_handle ? " by handle" : " inline",
                              c.targets ? "" : " no targets", c.overlap ? " overlapped" : ""));
    v1::ComputeHeader h = Header(v1::LOSS_KIND_DISTILL);
    h.mutable_distill()->set_jsd_beta(c.jsd_beta);
    h.mutable_options()->set_temperature(temperature);
    h.mutable_options()->set_grad_scale(grad_scale);
    h.set_overlap(c.overlap);
    v1::TensorSpec tx;
    tx.set_dtype(v1::DTYPE_FP32);
    tx.add_shape(kBt);
    tx.add_shape(kHt);
    *h.mutable_teacher_x() = tx;
    std::vector<v1::ComputeRequest> parts;
    for (v1::ComputeRequest& m : PartsFor(rp_, kPartBytes)) {
      if (c.targets || m.part().tensor() != v1::TENSOR_TARGETS) parts.push_back(std::move(m));
    }
    if (!c.targets) h.clear_targets();
    auto add = [&](v1::TensorId id, const std::vector<uint8_t>& bytes) {
      v1::ComputeRequest r;
      r.mutable_part()->set_tensor(id);
      r.mutable_part()->set_data(bytes.data(), bytes.size());
      parts.push_back(std::move(r));
    };
    add(v1::TENSOR_TEACHER_X, teacher.x);
    if (c.by_handle) {
      h.set_teacher_weight_handle(handle);
    } else {
      v1::TensorSpec tw = tx;
      tw.set_shape(0, kV);
      *h.mutable_teacher_w() = tw;
      add(v1::TENSOR_TEACHER_W, teacher.w);
      if (c.teacher_bias) {
        v1::TensorSpec tb;
        tb.set_dtype(v1::DTYPE_FP32);
        tb.add_shape(kV);
        *h.mutable_teacher_bias() = tb;
        add(v1::TENSOR_TEACHER_BIAS, teacher.bias);
      }
    }
    ComputeReply r = RunCompute(h_->stub(), h, c.overlap ? XLast(parts) : parts);
    ASSERT_TRUE(r.status.ok()) << r.status.error_message();

    DistillProblem dp;
    dp.student = Head();
    const LossProblem t = teacher.problem();
    dp.teacher = HeadInputs{t.bt, t.h, t.v, t.dtype, t.x, t.w,
                            c.by_handle || c.teacher_bias ? t.bias : nullptr};
    dp.labels = c.targets ? rp_.targets.data() : nullptr;
    dp.options.jsd_beta = c.jsd_beta;
    dp.options.temperature = temperature;
    dp.options.grad_scale = grad_scale;
    DistillReferenceOutputs ref;
    ASSERT_TRUE(DistillReference(dp, &ref).ok());
    ExpectNear(r.summary.loss(), ref.loss, "loss");
    EXPECT_GT(ref.loss, 0) << "a weak case: the two heads agree";
    EXPECT_EQ(r.summary.tokens(), ref.tokens);
    EXPECT_LT(RelNormError(Floats(r.tensors[v1::TENSOR_DX]), ref.grad.dx), kTol);
    EXPECT_LT(RelNormError(Floats(r.tensors[v1::TENSOR_DW]), ref.grad.dw), kTol);
    EXPECT_LT(RelNormError(Floats(r.tensors[v1::TENSOR_DB]), ref.grad.db), kTol);
  }
}

}  // namespace
}  // namespace testing_harness
}  // namespace lossd
