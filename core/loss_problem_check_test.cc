// SPDX-License-Identifier: Apache-2.0
// The one validation of a loss problem: a valid problem passes, and each rule refuses with
// INVALID_ARGUMENT and the message a client reads (the option and target ones) or one naming
// the field. The option rules come in the order the engine reports them.
#include "core/loss_problem_check.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace lossd {
namespace {

// A valid (BT=4, H=3, V=5) fp32 problem over this object's buffers.
struct Valid {
  std::vector<float> x = std::vector<float>(12, 0.5f), w = std::vector<float>(15, -0.25f);
  std::vector<float> bias = std::vector<float>(5, 0.1f);
  std::vector<int64_t> targets = {0, 4, -100, 2};
  LossProblem problem() const {
    LossProblem p;
    p.bt = 4;
    p.h = 3;
    p.v = 5;
    p.dtype = DType::kF32;
    p.x = x.data();
    p.w = w.data();
    p.targets = targets.data();
    return p;
  }
};

void ExpectRefused(const absl::Status& s, const std::string& message) {
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_EQ(s.message(), message);
}

TEST(LossProblemCheckTest, AValidProblemPasses) {
  Valid v;
  LossProblem p = v.problem();
  LossOutputs out;
  out.grad_dtype = DType::kF32;
  EXPECT_TRUE(ValidateLossProblem(p, out).ok());
  p.bias = v.bias.data();
  out.db = &v.bias[0];
  EXPECT_TRUE(ValidateLossProblem(p, out).ok());
  p.bt = 0;  // no rows: x and targets may be null
  p.x = nullptr;
  p.targets = nullptr;
  EXPECT_TRUE(ValidateLossProblem(p, out).ok());
}

TEST(LossProblemCheckTest, OptionsAreRefusedWithTheMessagesClientsRead) {
  LossOptions o;
  EXPECT_TRUE(CheckLossOptions(o, false).ok());
  o.reduction = static_cast<Reduction>(7);
  ExpectRefused(CheckLossOptions(o, false), "options.reduction 7 is unknown");
  o = LossOptions();
  ExpectRefused(CheckLossOptions(o, true),
                "grad_output is only accepted with reduction none (use options.grad_scale "
                "for mean and sum)");
  o.reduction = Reduction::kNone;
  EXPECT_TRUE(CheckLossOptions(o, true).ok());
  o.label_smoothing = 1.5f;
  ExpectRefused(CheckLossOptions(o, true), "options.label_smoothing must be in [0, 1], got 1.5");
  o.label_smoothing = std::nanf("");
  EXPECT_EQ(CheckOptionRanges(o).code(), absl::StatusCode::kInvalidArgument);
  o = LossOptions();
  o.z_loss_scale = std::numeric_limits<float>::infinity();
  ExpectRefused(CheckOptionRanges(o),
                "options.lse_square_scale must be finite and >= 0, got inf");
  o = LossOptions();
  o.softcap = -2.0f;
  ExpectRefused(CheckOptionRanges(o),
                "options.softcap must be finite and >= 0 (0 = off), got -2");
  o = LossOptions();
  o.grad_scale = std::numeric_limits<float>::infinity();
  ExpectRefused(CheckOptionRanges(o), "options.grad_scale must be finite, got inf");
  o = LossOptions();
  o.chunk_rows = -1;
  ExpectRefused(CheckLossOptions(o, false),
                "options.chunk_rows must be >= 0 (0 = automatic), got -1");
  // The order: an unknown reduction is reported before a bad range, a range before chunk_rows.
  o.label_smoothing = 2.0f;
  ExpectRefused(CheckLossOptions(o, false), "options.label_smoothing must be in [0, 1], got 2");
  o.reduction = static_cast<Reduction>(9);
  ExpectRefused(CheckLossOptions(o, false), "options.reduction 9 is unknown");
}

TEST(LossProblemCheckTest, TargetsOutsideTheVocabularyAreRefusedUnlessIgnored) {
  const std::vector<int32_t> t32 = {4, -7, 5};
  EXPECT_TRUE(CheckTargets(t32.data(), DType::kI32, 1, 5, -100).ok());
  ExpectRefused(CheckTargets(t32.data(), DType::kI32, 3, 5, -100),
                "targets[1] = -7 is outside [0, V=5) and is not ignore_index (-100)");
  EXPECT_TRUE(CheckTargets(t32.data(), DType::kI32, 2, 5, -7).ok());
  ExpectRefused(CheckTargets(t32.data(), DType::kI32, 3, 5, -7),
                "targets[2] = 5 is outside [0, V=5) and is not ignore_index (-7)");
  Valid v;
  v.targets[3] = 5;
  ExpectRefused(ValidateLossInputs(v.problem()),
                "targets[3] = 5 is outside [0, V=5) and is not ignore_index (-100)");
}

TEST(LossProblemCheckTest, EachInputRuleRefusesNamingItsField) {
  Valid v;
  LossProblem p = v.problem();
  p.h = 0;
  ExpectRefused(ValidateLossInputs(p),
                "loss problem: shape must have bt >= 0, h > 0, v > 0; got bt=4 h=0 v=5");
  p = v.problem();
  p.dtype = DType::kI32;
  ExpectRefused(ValidateLossInputs(p), "loss problem: dtype must be bf16, fp16 or fp32; got int32");
  p = v.problem();
  p.target_dtype = DType::kF32;
  ExpectRefused(ValidateLossInputs(p),
                "loss problem: target_dtype must be int32 or int64; got fp32");
  p = v.problem();
  p.targets = nullptr;
  ExpectRefused(ValidateLossInputs(p), "loss problem: x, w and targets must be non-null");
  p = v.problem();
  p.w_memory = static_cast<Memory>(3);
  ExpectRefused(ValidateLossInputs(p), "loss problem: w_memory 3 is unknown");
  p = v.problem();
  p.options.softcap = -1.0f;
  ExpectRefused(ValidateLossInputs(p), "options.softcap must be finite and >= 0 (0 = off), got -1");
  const float go[4] = {1, 1, 1, 1};
  p = v.problem();
  p.grad_output = go;  // with reduction mean
  EXPECT_EQ(ValidateLossInputs(p).code(), absl::StatusCode::kInvalidArgument);
  p.options.reduction = Reduction::kNone;
  EXPECT_TRUE(ValidateLossInputs(p).ok());
}

TEST(LossProblemCheckTest, EachOutputRuleRefusesNamingItsField) {
  Valid v;
  const LossProblem p = v.problem();
  LossOutputs out;
  out.grad_dtype = DType::kF16;  // fp32 input: fp16 gradients are neither
  ExpectRefused(ValidateLossOutputs(p, out),
                "loss problem: grad_dtype must be fp32 or the input dtype fp32; got fp16");
  out.grad_dtype = DType::kF32;
  float db[5];
  out.db_accum = db;  // no bias
  ExpectRefused(ValidateLossOutputs(p, out),
                "loss problem: db requested but the problem has no bias");
  out.db_accum = nullptr;
  out.accum_memory = static_cast<Memory>(2);
  ExpectRefused(ValidateLossOutputs(p, out), "loss problem: accum_memory 2 is unknown");
  EXPECT_EQ(ValidateLossProblem(p, out).code(), absl::StatusCode::kInvalidArgument);
}

// The same problem as another kind, with that kind's required inputs.
struct Kinds {
  Valid v;
  std::vector<float> per_row = {0.3f, -1.2f, 0.7f, 2.5f};
  std::vector<float> tx = std::vector<float>(8, 0.75f), tw = std::vector<float>(10, -0.5f);
  LossProblem of(LossKind kind) const {
    LossProblem p = v.problem();
    p.kind = kind;
    if (kind == LossKind::kPolicy) p.advantages = per_row.data();
    if (kind == LossKind::kDistill) {
      p.teacher_h = 2;
      p.teacher_x = tx.data();
      p.teacher_w = tw.data();
    }
    return p;
  }
};

TEST(LossProblemCheckTest, EveryKindPassesWithItsInputs) {
  Kinds k;
  LossOutputs out;
  out.grad_dtype = DType::kF32;
  float logp[4], entropy[4], kl, clip, loss;
  int64_t tokens;
  out.loss = &loss;
  out.tokens = &tokens;
  LossProblem p = k.of(LossKind::kLogprob);
  p.dlogp = k.per_row.data();
  p.dentropy = k.per_row.data();
  p.options.temperature = 0.7f;
  out.logp = logp;
  out.entropy = entropy;
  EXPECT_TRUE(ValidateLossProblem(p, out).ok()) << ValidateLossProblem(p, out);
  p = k.of(LossKind::kPolicy);
  p.old_logp = k.per_row.data();
  p.ref_logp = k.per_row.data();
  p.policy.sequences = 2;
  p.policy.loss_type = PolicyLossType::kDrGrpo;
  p.policy.max_completion_length = 2;
  out.entropy = nullptr;
  out.kl = &kl;
  out.clip_fraction = &clip;
  EXPECT_TRUE(ValidateLossProblem(p, out).ok()) << ValidateLossProblem(p, out);
  p = k.of(LossKind::kDistill);
  p.targets = nullptr;  // every row counts
  out = LossOutputs();
  out.grad_dtype = DType::kF32;
  EXPECT_TRUE(ValidateLossProblem(p, out).ok()) << ValidateLossProblem(p, out);
  // Distill's targets only mark ignored rows: any other value is accepted.
  std::vector<int64_t> labels = {7, -100, 123456, -3};
  p.targets = labels.data();
  EXPECT_TRUE(ValidateLossInputs(p).ok());
}

TEST(LossProblemCheckTest, TheTemperatureIsFinitePositiveAndOneForCrossEntropy) {
  Kinds k;
  LossProblem p = k.of(LossKind::kCrossEntropy);
  p.options.temperature = 2.0f;
  ExpectRefused(ValidateLossInputs(p),
                "options.temperature 2 applies to kinds logprob, policy and distill; "
                "cross_entropy takes 1 (scale the logits by the head instead)");
  p.options.temperature = std::nanf("");
  EXPECT_EQ(CheckKindOptions(p.kind, p.options, false, false).code(),
            absl::StatusCode::kInvalidArgument);
  p = k.of(LossKind::kLogprob);
  p.options.temperature = 0.0f;
  ExpectRefused(ValidateLossInputs(p), "options.temperature must be finite and > 0, got 0");
  p.options.temperature = std::numeric_limits<float>::infinity();
  ExpectRefused(ValidateLossInputs(p), "options.temperature must be finite and > 0, got inf");
}

TEST(LossProblemCheckTest, CrossEntropyOnlyOptionsAreRefusedForTheOtherKinds) {
  const LossKind kinds[] = {LossKind::kLogprob, LossKind::kPolicy, LossKind::kDistill};
  for (LossKind kind : kinds) {
    SCOPED_TRACE(LossKindName(kind));
    const std::string name = LossKindName(kind);
    LossOptions o;
    EXPECT_TRUE(CheckKindOptions(kind, o, false, false).ok());
    ExpectRefused(CheckKindOptions(kind, o, true, false),
                  "class_weights is for cross_entropy only; kind " + name +
                      " does not take it");
    ExpectRefused(CheckKindOptions(kind, o, false, true),
                  "grad_output is for cross_entropy only; kind " + name + " does not take it");
    o.reduction = Reduction::kSum;
    ExpectRefused(CheckKindOptions(kind, o, false, false),
                  "options.reduction 1 is for cross_entropy only; kind " + name +
                      " takes mean (0), its own reduction");
    o = LossOptions();
    o.label_smoothing = 0.25f;
    ExpectRefused(CheckKindOptions(kind, o, false, false),
                  "options.label_smoothing 0.25 is for cross_entropy only; kind " + name +
                      " takes 0");
    o = LossOptions();
    o.z_loss_scale = 1e-4f;
    ExpectRefused(CheckKindOptions(kind, o, false, false),
                  "options.lse_square_scale 0.0001 is for cross_entropy only; kind " + name +
                      " takes 0");
    o = LossOptions();
    o.token_scaling = true;
    ExpectRefused(CheckKindOptions(kind, o, false, false),
                  "options.token_scaling is for cross_entropy only; kind " + name +
                      " does not take it");
  }
  ExpectRefused(CheckKindOptions(static_cast<LossKind>(4), LossOptions(), false, false),
                "kind 4 is unknown");
  // A softcap is computed for logprob and policy, not for distill (a fuzzer's finding: the
  // backend refused what validation had let through).
  LossOptions capped;
  capped.softcap = 30.0f;
  EXPECT_TRUE(CheckKindOptions(LossKind::kLogprob, capped, false, false).ok());
  EXPECT_TRUE(CheckKindOptions(LossKind::kPolicy, capped, false, false).ok());
  ExpectRefused(CheckKindOptions(LossKind::kDistill, capped, false, false),
                "options.softcap 30 is not computed for kind distill; it takes 0");
  capped.softcap = std::nanf("");
  EXPECT_FALSE(CheckKindOptions(LossKind::kDistill, capped, false, false).ok());
  // Through the problem: the class weights are named as another kind's input.
  Kinds k;
  LossProblem p = k.of(LossKind::kLogprob);
  p.class_weights = k.per_row.data();
  ExpectRefused(ValidateLossInputs(p),
                "loss problem: class_weights is for kind cross_entropy, not logprob");
}

TEST(LossProblemCheckTest, EachKindsInputsAreRefusedForTheOthersAndRequiredForItself) {
  Kinds k;
  const float* f = k.per_row.data();
  struct Case {
    LossKind kind;
    void (*set)(LossProblem*, const float*);
    const char* message;
  };
  const Case cases[] = {
      {LossKind::kPolicy, [](LossProblem* p, const float* f) { p->dlogp = f; },
       "loss problem: dlogp is for kind logprob, not policy"},
      {LossKind::kDistill, [](LossProblem* p, const float* f) { p->dentropy = f; },
       "loss problem: dentropy is for kind logprob, not distill"},
      {LossKind::kLogprob, [](LossProblem* p, const float* f) { p->advantages = f; },
       "loss problem: advantages is for kind policy, not logprob"},
      {LossKind::kCrossEntropy, [](LossProblem* p, const float* f) { p->old_logp = f; },
       "loss problem: old_logp is for kind policy, not cross_entropy"},
      {LossKind::kDistill, [](LossProblem* p, const float* f) { p->ref_logp = f; },
       "loss problem: ref_logp is for kind policy, not distill"},
      {LossKind::kPolicy, [](LossProblem* p, const float* f) { p->teacher_x = f; },
       "loss problem: teacher_x is for kind distill, not policy"},
      {LossKind::kCrossEntropy, [](LossProblem* p, const float* f) { p->teacher_w = f; },
       "loss problem: teacher_w is for kind distill, not cross_entropy"},
      {LossKind::kLogprob, [](LossProblem* p, const float* f) { p->teacher_bias = f; },
       "loss problem: teacher_bias is for kind distill, not logprob"},
      {LossKind::kDistill, [](LossProblem* p, const float*) { p->grad_output = nullptr; },
       nullptr},
      {LossKind::kPolicy, [](LossProblem* p, const float*) { p->advantages = nullptr; },
       "loss problem: kind policy needs advantages"},
      {LossKind::kDistill, [](LossProblem* p, const float*) { p->teacher_h = -1; },
       "loss problem: kind distill needs teacher_h > 0; got -1"},
      {LossKind::kDistill, [](LossProblem* p, const float*) { p->teacher_x = nullptr; },
       "loss problem: kind distill needs teacher_x and teacher_w non-null"},
      {LossKind::kDistill, [](LossProblem* p, const float*) { p->teacher_w = nullptr; },
       "loss problem: kind distill needs teacher_x and teacher_w non-null"},
      {LossKind::kDistill,
       [](LossProblem* p, const float*) { p->teacher_w_memory = static_cast<Memory>(5); },
       "loss problem: teacher_w_memory 5 is unknown"},
      {static_cast<LossKind>(-1), [](LossProblem*, const float*) {},
       "loss problem: kind -1 is unknown"},
      {LossKind::kLogprob, [](LossProblem* p, const float*) { p->targets = nullptr; },
       "loss problem: x, w and targets must be non-null"},
  };
  for (const Case& c : cases) {
    LossProblem p = k.of(c.kind);
    c.set(&p, f);
    if (c.message == nullptr) {
      EXPECT_TRUE(ValidateLossInputs(p).ok()) << ValidateLossInputs(p);
    } else {
      ExpectRefused(ValidateLossInputs(p), c.message);
    }
  }
  // With no rows, policy's advantages and distill's teacher_x may be null, as x may.
  LossProblem p = k.of(LossKind::kPolicy);
  p.bt = 0;
  p.advantages = nullptr;
  EXPECT_TRUE(ValidateLossInputs(p).ok());
  p = k.of(LossKind::kDistill);
  p.bt = 0;
  p.teacher_x = nullptr;
  EXPECT_TRUE(ValidateLossInputs(p).ok());
}

TEST(LossProblemCheckTest, PolicyParamsAreRefusedNamingFieldAndValue) {
  PolicyParams pp;
  EXPECT_TRUE(CheckPolicyParams(pp, 6).ok());
  pp.loss_type = static_cast<PolicyLossType>(13);
  ExpectRefused(CheckPolicyParams(pp, 6),
                "policy.loss_type 13 is unknown (dapo 0, grpo 1, bnpo 2, dr_grpo 3, cispo 4, "
                "sapo 5, luspo 6, gpg 7, geo_mean 8, kl_cov 9, vespo 10, cispo_clamp 11)");
  pp = PolicyParams();
  pp.epsilon_low = -0.1f;
  ExpectRefused(CheckPolicyParams(pp, 6), "policy.epsilon_low must be finite and >= 0, got -0.1");
  pp = PolicyParams();
  pp.epsilon_high = std::numeric_limits<float>::infinity();
  ExpectRefused(CheckPolicyParams(pp, 6),
                "policy.epsilon_high must be finite and >= 0, got inf");
  pp = PolicyParams();
  pp.beta = std::nanf("");
  EXPECT_EQ(CheckPolicyParams(pp, 6).code(), absl::StatusCode::kInvalidArgument);
  pp = PolicyParams();
  pp.sequences = 4;
  ExpectRefused(CheckPolicyParams(pp, 6),
                "policy.sequences 4 must be > 0 and divide the rows (BT=6): the rows are "
                "that many sequences of equal length");
  pp.sequences = 0;
  EXPECT_EQ(CheckPolicyParams(pp, 6).code(), absl::StatusCode::kInvalidArgument);
  pp.sequences = 3;
  EXPECT_TRUE(CheckPolicyParams(pp, 6).ok());
  pp.loss_type = PolicyLossType::kDrGrpo;
  ExpectRefused(CheckPolicyParams(pp, 6),
                "policy.max_completion_length must be > 0 for loss type dr_grpo, got 0");
  pp.max_completion_length = 2;
  EXPECT_TRUE(CheckPolicyParams(pp, 6).ok());
  pp.loss_type = PolicyLossType::kGrpo;
  pp.max_completion_length = -2;
  ExpectRefused(CheckPolicyParams(pp, 6), "policy.max_completion_length must be >= 0, got -2");
  pp = PolicyParams();
  pp.dapo_normalizer = -3;
  ExpectRefused(CheckPolicyParams(pp, 6),
                "policy.dapo_normalizer must be finite and >= 0 (0 = the mask count), got -3");
  // Through the problem.
  Kinds k;
  LossProblem p = k.of(LossKind::kPolicy);
  p.policy.sequences = 3;
  ExpectRefused(ValidateLossInputs(p),
                "policy.sequences 3 must be > 0 and divide the rows (BT=4): the rows are "
                "that many sequences of equal length");
}

TEST(LossProblemCheckTest, PolicyTypeOptionsAreRefusedNamingFieldAndValue) {
  PolicyParams pp;
  for (PolicyLossType t : {PolicyLossType::kCispo, PolicyLossType::kSapo,
                           PolicyLossType::kLuspo}) {
    pp.loss_type = t;
    EXPECT_TRUE(CheckPolicyParams(pp, 6).ok()) << PolicyLossTypeName(t);
  }
  pp.loss_type = static_cast<PolicyLossType>(12);
  ExpectRefused(CheckPolicyParams(pp, 6),
                "policy.loss_type 12 is unknown (dapo 0, grpo 1, bnpo 2, dr_grpo 3, cispo 4, "
                "sapo 5, luspo 6, gpg 7, geo_mean 8, kl_cov 9, vespo 10, cispo_clamp 11)");
  pp = PolicyParams();
  pp.sapo_temperature_pos = 0.0f;
  ExpectRefused(CheckPolicyParams(pp, 6),
                "policy.sapo_temperature_pos must be finite and > 0, got 0");
  pp = PolicyParams();
  pp.sapo_temperature_neg = -std::numeric_limits<float>::infinity();
  ExpectRefused(CheckPolicyParams(pp, 6),
                "policy.sapo_temperature_neg must be finite and > 0, got -inf");
  pp = PolicyParams();
  pp.epsilon_high = 0.25f;
  pp.delta = 1.25f;  // not > 1 + epsilon_high
  ExpectRefused(CheckPolicyParams(pp, 6),
                "policy.delta must be unset (0) or finite and > 1 + epsilon_high = 1.25, "
                "got 1.25");
  pp.delta = -1.0f;
  ExpectRefused(CheckPolicyParams(pp, 6),
                "policy.delta must be unset (0) or finite and > 1 + epsilon_high = 1.25, got -1");
  pp.delta = std::numeric_limits<float>::infinity();
  ExpectRefused(CheckPolicyParams(pp, 6),
                "policy.delta must be unset (0) or finite and > 1 + epsilon_high = 1.25, got inf");
  pp.delta = 1.5f;
  for (PolicyLossType t : {PolicyLossType::kDapo, PolicyLossType::kGrpo, PolicyLossType::kBnpo,
                           PolicyLossType::kLuspo}) {
    pp.loss_type = t;
    EXPECT_TRUE(CheckPolicyParams(pp, 6).ok()) << PolicyLossTypeName(t);
  }
  pp.loss_type = PolicyLossType::kSapo;
  ExpectRefused(CheckPolicyParams(pp, 6),
                "policy.delta caps the ratio of the clipped loss types (dapo, grpo, bnpo, "
                "dr_grpo, luspo); loss type sapo has no clipped surrogate");
  pp.loss_type = PolicyLossType::kCispo;
  ExpectRefused(CheckPolicyParams(pp, 6),
                "policy.delta caps the ratio of the clipped loss types (dapo, grpo, bnpo, "
                "dr_grpo, luspo); loss type cispo has no clipped surrogate");
  pp.use_bias_correction_kl = true;
  pp.delta = 0.0f;
  EXPECT_TRUE(CheckPolicyParams(pp, 6).ok());
}

TEST(LossProblemCheckTest, SequenceImportanceSamplingIsCheckedOnce) {
  PolicyParams pp;
  pp.importance_sampling = ImportanceSampling::kSequence;
  for (PolicyLossType t : {PolicyLossType::kDapo, PolicyLossType::kGrpo, PolicyLossType::kBnpo,
                           PolicyLossType::kLuspo}) {
    pp.loss_type = t;
    EXPECT_TRUE(CheckPolicyParams(pp, 6).ok()) << PolicyLossTypeName(t);
  }
  pp.loss_type = PolicyLossType::kCispo;
  ExpectRefused(CheckPolicyParams(pp, 6),
                "policy.importance_sampling sequence is for the clipped loss types (dapo, grpo, "
                "bnpo, dr_grpo, luspo); loss type cispo takes token-level ratios only");
  pp.loss_type = PolicyLossType::kSapo;
  ExpectRefused(CheckPolicyParams(pp, 6), "policy.importance_sampling sequence is for the clipped loss types (dapo, grpo, bnpo, "
                "dr_grpo, luspo); loss type sapo takes token-level ratios only");
  pp = PolicyParams();
  pp.importance_sampling = static_cast<ImportanceSampling>(5);
  ExpectRefused(CheckPolicyParams(pp, 6),
                "policy.importance_sampling 5 is unknown (token 0, sequence 1)");
}

TEST(LossProblemCheckTest, VerlOptionsAreCheckedOnce) {
  PolicyParams pp;
  pp.loss_type = PolicyLossType::kGpg;
  pp.kl_estimator = KlEstimator::kLowVarKl;
  pp.kl_straight_through = true;
  pp.entropy_coeff = -0.01f;
  pp.aggregation = PolicyAggregation::kSeqMeanTokenSumNorm;
  pp.loss_scale_factor = 4096;
  EXPECT_TRUE(CheckPolicyParams(pp, 6).ok());
  PolicyParams bad = pp;
  bad.kl_estimator = static_cast<KlEstimator>(7);
  ExpectRefused(CheckPolicyParams(bad, 6),
                "policy.kl_estimator 7 is unknown (k3 0, k1 1, k2 2, abs 3, low_var_kl 4)");
  bad = pp;
  bad.entropy_coeff = std::nanf("");
  ExpectRefused(CheckPolicyParams(bad, 6), "policy.entropy_coeff must be finite, got nan");
  bad = pp;
  bad.aggregation = static_cast<PolicyAggregation>(5);
  ExpectRefused(CheckPolicyParams(bad, 6),
                "policy.aggregation 5 is unknown (loss_type 0, token-mean 1, seq-mean-token-sum "
                "2, seq-mean-token-mean 3, seq-mean-token-sum-norm 4)");
  bad = pp;
  bad.loss_scale_factor = -1;
  ExpectRefused(CheckPolicyParams(bad, 6),
                "policy.loss_scale_factor must be finite and >= 0 (0 = the sequence length S), "
                "got -1");
  bad = pp;
  bad.aggregation = PolicyAggregation::kTokenMean;
  ExpectRefused(CheckPolicyParams(bad, 6),
                "policy.loss_scale_factor 4096 is for aggregation seq-mean-token-sum-norm; this "
                "request's is token-mean");
  bad = pp;
  bad.importance_sampling = ImportanceSampling::kSequence;
  ExpectRefused(CheckPolicyParams(bad, 6),
                "policy.importance_sampling sequence is for the clipped loss types (dapo, grpo, "
                "bnpo, dr_grpo, luspo); loss type gpg takes token-level ratios only");
  bad = pp;
  bad.delta = 3.0f;
  ExpectRefused(CheckPolicyParams(bad, 6),
                "policy.delta caps the ratio of the clipped loss types (dapo, grpo, bnpo, "
                "dr_grpo, luspo); loss type gpg has no clipped surrogate");
}

// geo_mean takes verl's options; not a second importance-sampling level, delta or the
// ratio-weighted KL.
TEST(LossProblemCheckTest, GeoMeanRefusesSequenceLevelDeltaAndBiasCorrection) {
  PolicyParams pp;
  pp.loss_type = PolicyLossType::kGeoMean;
  pp.kl_estimator = KlEstimator::kLowVarKl;
  pp.entropy_coeff = 0.01f;
  pp.aggregation = PolicyAggregation::kTokenMean;
  EXPECT_TRUE(CheckPolicyParams(pp, 6).ok());
  PolicyParams bad = pp;
  bad.importance_sampling = ImportanceSampling::kSequence;
  ExpectRefused(CheckPolicyParams(bad, 6),
                "policy.importance_sampling sequence does not apply to loss type geo_mean, which "
                "clips each token's log-ratio and takes each sequence's geometric mean itself");
  bad = pp;
  bad.use_bias_correction_kl = true;
  ExpectRefused(CheckPolicyParams(bad, 6),
                "policy.use_bias_correction_kl does not apply to loss type geo_mean (its KL term "
                "is verl's, not weighted by a ratio)");
  bad = pp;
  bad.delta = 3.0f;
  ExpectRefused(CheckPolicyParams(bad, 6),
                "policy.delta caps the ratio of the clipped loss types (dapo, grpo, bnpo, "
                "dr_grpo, luspo); loss type geo_mean has no clipped surrogate");
}

// vespo takes the ratio-weighted KL and verl's options (as Liger, which weights the KL by the
// token ratio); not a sequence level, delta, a non-finite shape or a negative rate.
TEST(LossProblemCheckTest, VespoRefusesSequenceLevelDeltaAndBadGammaParameters) {
  PolicyParams pp;
  pp.loss_type = PolicyLossType::kVespo;
  pp.use_bias_correction_kl = true;
  pp.aggregation = PolicyAggregation::kSeqMeanTokenMean;
  pp.vespo_lambda_neg = 0.0f;  // a rate of 0 is taken (Liger's floor 1e-4 applies)
  EXPECT_TRUE(CheckPolicyParams(pp, 6).ok());
  PolicyParams bad = pp;
  bad.importance_sampling = ImportanceSampling::kSequence;
  ExpectRefused(CheckPolicyParams(bad, 6),
                "policy.importance_sampling sequence does not apply to loss type vespo, whose "
                "weight is its sequence's already (as Liger's)");
  bad = pp;
  bad.delta = 3.0f;
  ExpectRefused(CheckPolicyParams(bad, 6),
                "policy.delta caps the ratio of the clipped loss types (dapo, grpo, bnpo, "
                "dr_grpo, luspo); loss type vespo has no clipped surrogate");
  bad = pp;
  bad.vespo_k_neg = INFINITY;
  ExpectRefused(CheckPolicyParams(bad, 6), "policy.vespo_k_neg must be finite, got inf");
  bad = pp;
  bad.vespo_lambda_pos = -0.5f;
  ExpectRefused(CheckPolicyParams(bad, 6),
                "policy.vespo_lambda_pos must be finite and >= 0 (a gamma rate), got -0.5");
  bad = pp;  // checked with vespo only, as kl_cov's options are with kl_cov
  bad.loss_type = PolicyLossType::kDapo;
  bad.use_bias_correction_kl = false;
  bad.vespo_lambda_pos = -0.5f;
  EXPECT_TRUE(CheckPolicyParams(bad, 6).ok());
}

TEST(LossProblemCheckTest, DistillParamsAreRefusedNamingFieldAndValue) {
  DistillParams d;
  EXPECT_TRUE(CheckDistillParams(d).ok());
  d.jsd_beta = 0.0f;
  EXPECT_TRUE(CheckDistillParams(d).ok());
  d.jsd_beta = 1.0f;
  EXPECT_TRUE(CheckDistillParams(d).ok());
  d.jsd_beta = 1.5f;
  ExpectRefused(CheckDistillParams(d), "distill.jsd_beta must be in [0, 1], got 1.5");
  d.jsd_beta = std::nanf("");
  EXPECT_EQ(CheckDistillParams(d).code(), absl::StatusCode::kInvalidArgument);
  Kinds k;
  LossProblem p = k.of(LossKind::kDistill);
  p.distill.jsd_beta = -0.5f;
  ExpectRefused(ValidateLossInputs(p), "distill.jsd_beta must be in [0, 1], got -0.5");
}

#ifndef NDEBUG
TEST(LossProblemCheckDeathTest, TheDebugCheckAbortsOnAnInvalidProblemNamingTheCaller) {
  Valid v;
  LossProblem p = v.problem();
  LOSSD_DCHECK_VALID_PROBLEM(p, nullptr, "test backend");  // valid: goes on
  p.v = 0;
  EXPECT_DEATH(LOSSD_DCHECK_VALID_PROBLEM(p, nullptr, "test backend"),
               "test backend was handed a problem that was never validated: .*v=0");
}
#endif

}  // namespace
}  // namespace lossd
