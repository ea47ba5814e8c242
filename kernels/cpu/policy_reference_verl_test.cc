// SPDX-License-Identifier: Apache-2.0
// Tests of the float64 policy-loss reference's options from verl's menu: the KL estimators
// (k1, k2, k3, abs, low_var_kl, and the straight-through '+'), the entropy bonus, the four
// aggregation modes and the gpg loss type: the gradient against central finite differences,
// closed forms (each estimator's value, an aggregation that equals a loss type's), and the
// refusals.
#include <cmath>
#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include "gtest/gtest.h"
#include "core/dtype.h"
#include "core/loss_problem.h"
#include "kernels/cpu/policy_reference.h"
#include "kernels/cpu/reference_head.h"
#include "testing/cpu/policy_test_util.h"

namespace lossd {
namespace {

constexpr KlEstimator kEstimators[] = {KlEstimator::kK3, KlEstimator::kK1, KlEstimator::kK2,
                                       KlEstimator::kAbs, KlEstimator::kLowVarKl};

using KlParam = std::tuple<KlEstimator, PolicyLossType, ImportanceSampling,
                           bool /*bias correction*/, bool /*entropy*/, bool /*mask*/>;

class PolicyKlEstimatorFiniteDifferenceTest : public ::testing::TestWithParam<KlParam> {};

// Every estimator, with and without the entropy bonus, at both levels: the gradient is the
// loss's (with the old log-probs given, so nothing is detached but the reference's).
TEST_P(PolicyKlEstimatorFiniteDifferenceTest, GradientMatchesFiniteDifferences) {
  const auto [estimator, type, level, bias_correction, entropy, masked] = GetParam();
  Inputs in(2, 4, 3, 6, 53);
  PolicyProblem p = in.Problem(true);
  PolicyOptions& o = p.options;
  o.loss_type = type;
  o.importance_sampling = level;
  o.epsilon_high = 0.28f;
  o.kl_estimator = estimator;
  o.use_bias_correction_kl = bias_correction;
  o.entropy_coeff = entropy ? 0.35f : 0.0f;
  o.temperature = 0.9f;
  o.beta = 0.3f;
  o.grad_scale = 0.75f;
  if (masked) {
    in.MaskUnread(2);
    in.MaskUnread(5);
  }
  const std::vector<double> logp = in.CurrentLogprobs(p);
  SetOldAndRefLogprobs(logp, 17, true, kKlWithRef, &in, &p);
  PolicyReferenceOutputs r;
  ASSERT_TRUE(PolicyReference(p, &r).ok());
  ExpectHeadGradientMatches(in, r.grad, true, [&]() { return ScaledLoss(p); });
}

std::string KlName(const ::testing::TestParamInfo<KlParam>& info) {
  const auto [estimator, type, level, bias_correction, entropy, masked] = info.param;
  return std::string(KlEstimatorName(estimator)) + "_" + PolicyLossTypeName(type) + "_" +
         ImportanceSamplingName(level) + (bias_correction ? "_biascorr" : "") +
         (entropy ? "_entropy" : "") + (masked ? "_mask" : "");
}

INSTANTIATE_TEST_SUITE_P(
    Estimators, PolicyKlEstimatorFiniteDifferenceTest,
    ::testing::Combine(::testing::ValuesIn(kEstimators),
                       ::testing::Values(PolicyLossType::kDapo, PolicyLossType::kGrpo),
                       ::testing::Values(ImportanceSampling::kToken,
                                         ImportanceSampling::kSequence),
                       ::testing::Bool(), ::testing::Bool(), ::testing::Bool()),
    KlName);

// Each estimator's per-token value, from its formula at d = logp - ref.
TEST(PolicyKlEstimatorReferenceTest, ValuesAreTheEstimators) {
  Inputs in(1, 6, 3, 5, 61);
  PolicyProblem p = in.Problem(false);
  p.options.beta = 0.5f;
  const std::vector<double> logp = in.CurrentLogprobs(p);
  // ref - logp: small, both signs, past low_var_kl's value clamp (e^3 - 4 > 10) and past its
  // argument clamp (25 > 20).
  const double shifts[6] = {0.4, -0.7, 1.3, -2.5, 3.0, 25.0};
  for (int64_t i = 0; i < in.bt; ++i) in.ref_logp[i] = static_cast<float>(logp[i] + shifts[i]);
  for (KlEstimator e : kEstimators) {
    p.options.kl_estimator = e;
    PolicyReferenceOutputs r;
    ASSERT_TRUE(PolicyReference(p, &r).ok());
    for (int64_t i = 0; i < in.bt; ++i) {
      const double d = r.logp[i] - in.ref_logp[i];
      double want = 0;
      switch (e) {
        case KlEstimator::kK3: want = std::exp(-d) + d - 1; break;
        case KlEstimator::kK1: want = d; break;
        case KlEstimator::kK2: want = d * d / 2; break;
        case KlEstimator::kAbs: want = std::abs(d); break;
        case KlEstimator::kLowVarKl: {
          const double c = std::min(20.0, -d);
          want = std::min(10.0, std::exp(c) - c - 1);
          break;
        }
      }
      EXPECT_NEAR(r.kl_token[i], want, 1e-9 * std::max(1.0, std::abs(want)))
          << KlEstimatorName(e) << " row " << i;
    }
  }
}

// low_var_kl passes no gradient where a clamp holds: rows past them give the gradient of a
// problem without their KL term (beta 0 there is the same as ref = logp for the gradient).
TEST(PolicyKlEstimatorReferenceTest, LowVarKlClampsPassNoGradient) {
  Inputs in(1, 4, 3, 5, 67);
  PolicyProblem p = in.Problem(false);
  p.options.beta = 0.5f;
  p.options.kl_estimator = KlEstimator::kLowVarKl;
  const std::vector<double> logp = in.CurrentLogprobs(p);
  for (int64_t i = 0; i < in.bt; ++i) in.ref_logp[i] = static_cast<float>(logp[i] + 3.0 + 20 * i);
  PolicyReferenceOutputs clamped, no_kl;
  ASSERT_TRUE(PolicyReference(p, &clamped).ok());
  p.options.beta = 0.0f;
  ASSERT_TRUE(PolicyReference(p, &no_kl).ok());
  EXPECT_NEAR(clamped.loss - no_kl.loss, 0.5 * 10.0, 1e-9);  // every row at the value clamp
  ExpectNearAll(clamped.grad.dw, no_kl.grad.dw, 1e-12, "dw");
  ExpectNearAll(clamped.grad.dx, no_kl.grad.dx, 1e-12, "dx");
}

// Straight-through (verl's "k3+"): K's value, k2's gradient. So the loss is the plain
// estimator's and the gradients those of the same problem with k2.
TEST(PolicyKlEstimatorReferenceTest, StraightThroughHasKsValueAndK2sGradient) {
  for (KlEstimator e : kEstimators) {
    for (ImportanceSampling level : {ImportanceSampling::kToken, ImportanceSampling::kSequence}) {
      Inputs in(2, 4, 3, 6, 71);
      in.MaskUnread(6);
      PolicyProblem p = in.Problem(true);
      p.options.beta = 0.4f;
      p.options.importance_sampling = level;
      const std::vector<double> logp = in.CurrentLogprobs(p);
      SetOldAndRefLogprobs(logp, 19, true, kKlWithRef, &in, &p);
      p.options.kl_estimator = e;
      PolicyReferenceOutputs plain, st, k2;
      ASSERT_TRUE(PolicyReference(p, &plain).ok());
      p.options.kl_straight_through = true;
      ASSERT_TRUE(PolicyReference(p, &st).ok());
      p.options.kl_estimator = KlEstimator::kK2;
      p.options.kl_straight_through = false;
      ASSERT_TRUE(PolicyReference(p, &k2).ok());
      EXPECT_EQ(st.loss, plain.loss) << KlEstimatorName(e);
      EXPECT_EQ(st.kl, plain.kl) << KlEstimatorName(e);
      ExpectNearAll(st.grad.dw, k2.grad.dw, 1e-12, KlEstimatorName(e));
      ExpectNearAll(st.grad.dx, k2.grad.dx, 1e-12, KlEstimatorName(e));
      ExpectNearAll(st.grad.db, k2.grad.db, 1e-12, KlEstimatorName(e));
    }
  }
}

constexpr PolicyAggregation kAggregations[] = {
    PolicyAggregation::kTokenMean, PolicyAggregation::kSeqMeanTokenSum,
    PolicyAggregation::kSeqMeanTokenMean, PolicyAggregation::kSeqMeanTokenSumNorm};

using AggParam = std::tuple<PolicyAggregation, PolicyLossType, ImportanceSampling,
                            int /*0 none, 1 rows, 2 a whole sequence*/, bool /*normaliser*/>;

class PolicyAggregationFiniteDifferenceTest : public ::testing::TestWithParam<AggParam> {};

TEST_P(PolicyAggregationFiniteDifferenceTest, GradientMatchesFiniteDifferences) {
  const auto [aggregation, type, level, masked, normaliser] = GetParam();
  Inputs in(2, 4, 3, 6, 73);
  PolicyProblem p = in.Problem(true);
  PolicyOptions& o = p.options;
  o.loss_type = type;
  o.importance_sampling = level;
  o.epsilon_high = 0.28f;
  o.aggregation = aggregation;
  o.beta = 0.2f;
  o.entropy_coeff = 0.1f;
  o.grad_scale = 1.25f;
  if (normaliser) {
    o.dapo_normalizer = 7.5;
    o.loss_scale_factor = 3.0;
  }
  if (masked >= 1) in.MaskUnread(1);
  if (masked == 2) {
    for (int64_t i = 4; i < 8; ++i) in.MaskUnread(i);
  }
  const std::vector<double> logp = in.CurrentLogprobs(p);
  SetOldAndRefLogprobs(logp, 23, true, kKlWithRef, &in, &p);
  PolicyReferenceOutputs r;
  ASSERT_TRUE(PolicyReference(p, &r).ok());
  ExpectHeadGradientMatches(in, r.grad, true, [&]() { return ScaledLoss(p); });
}

std::string AggName(const ::testing::TestParamInfo<AggParam>& info) {
  const auto [aggregation, type, level, masked, normaliser] = info.param;
  std::string name = PolicyAggregationName(aggregation);
  for (char& c : name) c = c == '-' ? '_' : c;
  return name + "_" + PolicyLossTypeName(type) + "_" + ImportanceSamplingName(level) +
         (masked == 1 ? "_mask" : masked == 2 ? "_emptyseq" : "") + (normaliser ? "_given" : "");
}

INSTANTIATE_TEST_SUITE_P(
    Modes, PolicyAggregationFiniteDifferenceTest,
    ::testing::Combine(::testing::ValuesIn(kAggregations),
                       ::testing::Values(PolicyLossType::kDapo, PolicyLossType::kSapo,
                                         PolicyLossType::kGpg),
                       ::testing::Values(ImportanceSampling::kToken),
                       ::testing::Values(0, 1, 2), ::testing::Bool()),
    AggName);

INSTANTIATE_TEST_SUITE_P(
    SequenceLevel, PolicyAggregationFiniteDifferenceTest,
    ::testing::Combine(::testing::ValuesIn(kAggregations),
                       ::testing::Values(PolicyLossType::kGrpo),
                       ::testing::Values(ImportanceSampling::kSequence),
                       ::testing::Values(0, 2), ::testing::Values(false)),
    AggName);

// With no empty sequence the modes are loss types: token-mean is bnpo, seq-mean-token-mean
// grpo, seq-mean-token-sum dr_grpo with max_completion_length 1, seq-mean-token-sum-norm
// dr_grpo with max_completion_length S; and an empty sequence leaves G (not B) counting.
TEST(PolicyAggregationReferenceTest, ModesMatchTheirLossTypes) {
  Inputs in(2, 4, 3, 6, 79);
  in.MaskUnread(2);
  PolicyProblem p = in.Problem(true);
  p.options.beta = 0.2f;
  const std::vector<double> logp = in.CurrentLogprobs(p);
  SetOldAndRefLogprobs(logp, 29, true, kKlWithRef, &in, &p);
  auto run = [&](PolicyLossType type, PolicyAggregation a, int64_t mcl) {
    PolicyProblem q = p;
    q.options.loss_type = type;
    q.options.aggregation = a;
    q.options.max_completion_length = mcl;
    PolicyReferenceOutputs r;
    EXPECT_TRUE(PolicyReference(q, &r).ok());
    return r;
  };
  const struct {
    PolicyAggregation a;
    PolicyLossType type;
    int64_t mcl;
  } pairs[] = {{PolicyAggregation::kTokenMean, PolicyLossType::kBnpo, 0},
               {PolicyAggregation::kSeqMeanTokenMean, PolicyLossType::kGrpo, 0},
               {PolicyAggregation::kSeqMeanTokenSum, PolicyLossType::kDrGrpo, 1},
               {PolicyAggregation::kSeqMeanTokenSumNorm, PolicyLossType::kDrGrpo, 4}};
  for (const auto& pr : pairs) {
    const PolicyReferenceOutputs mode = run(PolicyLossType::kDapo, pr.a, 0);
    const PolicyReferenceOutputs type = run(pr.type, PolicyAggregation::kLossType, pr.mcl);
    EXPECT_NEAR(mode.loss, type.loss, 1e-12) << PolicyAggregationName(pr.a);
    ExpectNearAll(mode.grad.dw, type.grad.dw, 1e-12, PolicyAggregationName(pr.a));
  }
  // The second sequence empty: seq-mean-token-sum divides by G = 1, dr_grpo by B = 2.
  for (int64_t i = 4; i < 8; ++i) in.MaskUnread(i);
  const PolicyReferenceOutputs g = run(PolicyLossType::kDapo, PolicyAggregation::kSeqMeanTokenSum, 0);
  const PolicyReferenceOutputs b = run(PolicyLossType::kDrGrpo, PolicyAggregation::kLossType, 1);
  EXPECT_NEAR(g.loss, 2 * b.loss, 1e-12);
}

// gpg: -A logp with dapo's normaliser, whatever the old log-probs; no clip fraction.
TEST(PolicyGpgReferenceTest, IsMinusAdvantageTimesLogp) {
  Inputs in(2, 4, 3, 6, 83);
  in.MaskUnread(5);
  PolicyProblem p = in.Problem(true);
  p.options.loss_type = PolicyLossType::kGpg;
  p.options.beta = 0.0f;
  const std::vector<double> logp = in.CurrentLogprobs(p);
  SetOldAndRefLogprobs(logp, 31, true, kNoKl, &in, &p);
  PolicyReferenceOutputs r;
  ASSERT_TRUE(PolicyReference(p, &r).ok());
  double want = 0;
  for (int64_t i = 0; i < in.bt; ++i) want += in.mask[i] * -in.advantages[i] * logp[i] / 7.0;
  EXPECT_NEAR(r.loss, want, 1e-12);
  EXPECT_EQ(r.clip_fraction, 0.0);
  p.old_logp = nullptr;
  PolicyReferenceOutputs no_old;
  ASSERT_TRUE(PolicyReference(p, &no_old).ok());
  EXPECT_EQ(no_old.loss, r.loss);
}

TEST(PolicyVerlReferenceTest, RejectsBadOptions) {
  Inputs in(2, 2, 3, 4, 89);
  PolicyProblem p = in.Problem(false);
  PolicyProblem q = p;
  q.options.kl_estimator = static_cast<KlEstimator>(5);
  ExpectRefused(q, "options.kl_estimator 5 is not k3, k1, k2, abs or low_var_kl");
  q = p;
  q.options.entropy_coeff = INFINITY;
  ExpectRefused(q, "options.entropy_coeff must be finite, got inf");
  q = p;
  q.options.aggregation = static_cast<PolicyAggregation>(-1);
  ExpectRefused(q, "options.aggregation -1 is not loss_type, token-mean");
  q = p;
  q.options.loss_scale_factor = -2;
  ExpectRefused(q, "options.loss_scale_factor must be finite and >= 0 (0 = S), got -2");
  q = p;
  q.options.loss_type = PolicyLossType::kGpg;
  q.options.delta = 2.0f;
  ExpectRefused(q, "options.delta applies to the clipped loss types; loss_type gpg");
  q = p;
  q.options.loss_type = PolicyLossType::kGpg;
  q.options.importance_sampling = ImportanceSampling::kSequence;
  ExpectRefused(q, "loss_type gpg takes token-level ratios only");
  q = p;
  q.options.loss_type = static_cast<PolicyLossType>(12);
  ExpectRefused(q, "options.loss_type 12 is not dapo, grpo, bnpo, dr_grpo, cispo, sapo, luspo");
}

}  // namespace
}  // namespace lossd
