// SPDX-License-Identifier: Apache-2.0
// Tests of the float64 policy-loss reference's geo_mean loss type (verl's GMPO: each token's
// log-ratio clipped on its advantage's side, each sequence's geometric mean, the mean over the
// sequences of -mean(A) R): the gradient against central finite differences with the KL term,
// the entropy bonus, masks, an empty sequence, the rollout correction and the aggregations;
// closed forms (no clipping: R_b is GSPO's sequence ratio; no old log-probs: the loss is
// -mean(A)); the clipped rows pass no gradient and are counted; the refusals.
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

// (KL estimator or none, entropy, 0 no mask / 1 rows / 2 a whole sequence, is_ratio,
// aggregation)
using GeoParam = std::tuple<int /*-1: beta 0, else a KlEstimator*/, bool, int, bool,
                            PolicyAggregation>;

class PolicyGeoMeanFiniteDifferenceTest : public ::testing::TestWithParam<GeoParam> {};

// The finite-difference ratios' log-ratios (-0.60 .. 0.41) sit away from geo_mean's bounds
// -0.2 and 0.28 by more than a step moves them, so the loss is smooth there, and rows on
// both sides of each bound are clipped or not by their advantage's sign.
TEST_P(PolicyGeoMeanFiniteDifferenceTest, GradientMatchesFiniteDifferences) {
  const auto [estimator, entropy, masked, rho, aggregation] = GetParam();
  Inputs in(2, 4, 3, 6, 97);
  PolicyProblem p = in.Problem(true);
  PolicyOptions& o = p.options;
  o.loss_type = PolicyLossType::kGeoMean;
  o.epsilon_high = 0.28f;
  o.beta = estimator >= 0 ? 0.3f : 0.0f;
  if (estimator >= 0) o.kl_estimator = static_cast<KlEstimator>(estimator);
  o.entropy_coeff = entropy ? 0.25f : 0.0f;
  o.aggregation = aggregation;
  o.temperature = 0.9f;
  o.grad_scale = 0.75f;
  if (masked >= 1) in.MaskUnread(2);
  if (masked == 2) {
    for (int64_t i = 4; i < 8; ++i) in.MaskUnread(i);
  }
  const std::vector<float> weights = {0.5f, 1.5f, 0.9f, 2.0f, 1.1f, 0.3f, 1.0f, 0.7f};
  if (rho) p.is_ratio = weights.data();
  const std::vector<double> logp = in.CurrentLogprobs(p);
  SetOldAndRefLogprobs(logp, 41, true, estimator >= 0 ? kKlWithRef : kNoKl, &in, &p);
  PolicyReferenceOutputs r;
  ASSERT_TRUE(PolicyReference(p, &r).ok());
  ExpectHeadGradientMatches(in, r.grad, true, [&]() { return ScaledLoss(p); });
}

std::string GeoName(const ::testing::TestParamInfo<GeoParam>& info) {
  const auto [estimator, entropy, masked, rho, aggregation] = info.param;
  std::string agg = PolicyAggregationName(aggregation);
  for (char& c : agg) c = c == '-' ? '_' : c;
  return std::string(estimator < 0 ? "nokl"
                                   : KlEstimatorName(static_cast<KlEstimator>(estimator))) +
         (entropy ? "_entropy" : "") + (masked == 1 ? "_mask" : masked == 2 ? "_emptyseq" : "") +
         (rho ? "_isratio" : "") + "_" + agg;
}

INSTANTIATE_TEST_SUITE_P(
    Options, PolicyGeoMeanFiniteDifferenceTest,
    ::testing::Combine(::testing::Values(-1, static_cast<int>(KlEstimator::kK3),
                                         static_cast<int>(KlEstimator::kLowVarKl)),
                       ::testing::Bool(), ::testing::Values(0, 1, 2), ::testing::Bool(),
                       ::testing::Values(PolicyAggregation::kLossType,
                                         PolicyAggregation::kTokenMean)),
    GeoName);

// With bounds no log-ratio reaches, R_b is GSPO's sequence ratio exp(mean(logp - old)), and the
// loss the mean over the sequences of -mean(A)_b R_b.
TEST(PolicyGeoMeanReferenceTest, UnclippedRatioIsTheSequencesGeometricMean) {
  Inputs in(2, 4, 3, 6, 101);
  in.MaskUnread(6);
  PolicyProblem p = in.Problem(true);
  p.options.beta = 0.0f;
  const std::vector<double> logp = in.CurrentLogprobs(p);
  SetOldAndRefLogprobs(logp, 43, true, kNoKl, &in, &p);
  p.options.epsilon_low = 5.0f;
  p.options.epsilon_high = 5.0f;
  PolicyProblem gspo = p;
  gspo.options.loss_type = PolicyLossType::kGrpo;
  gspo.options.importance_sampling = ImportanceSampling::kSequence;
  p.options.loss_type = PolicyLossType::kGeoMean;
  const PolicyReferenceOutputs geo = RunPolicyReference(p), seq = RunPolicyReference(gspo);
  double want = 0;
  for (int64_t b = 0; b < 2; ++b) {
    double a = 0, n = 0;
    for (int64_t i = 4 * b; i < 4 * b + 4; ++i) {
      if (!in.mask[i]) continue;
      EXPECT_NEAR(geo.ratio[i], seq.ratio[i], 1e-14 * seq.ratio[i]) << i;
      a += in.advantages[i];
      n += 1;
    }
    want += -(a / n) * seq.ratio[4 * b] / 2.0;
  }
  EXPECT_NEAR(geo.loss, want, 1e-13);
  EXPECT_EQ(geo.clip_fraction, 0.0);
}

// Without old log-probs every log-ratio is 0 (the current ones detached): R_b = 1 and the loss
// -(1/B) sum_b mean(A)_b; each row's dloss/dlogp is that sequence's -mean(A)_b / (B n_b) over
// its weight, the rows with A = 0 excepted.
TEST(PolicyGeoMeanReferenceTest, WithoutOldLogprobsTheLossIsMinusTheMeanAdvantage) {
  Inputs in(2, 4, 3, 6, 103);
  in.advantages[5] = 0.0f;
  PolicyProblem p = in.Problem(false);
  p.options.loss_type = PolicyLossType::kGeoMean;
  p.options.beta = 0.0f;
  p.old_logp = nullptr;
  const PolicyReferenceOutputs r = RunPolicyReference(p);
  double want = 0;
  double mean[2] = {0, 0};
  for (int64_t i = 0; i < in.bt; ++i) mean[i / 4] += in.advantages[i] / 4.0;
  want = -(mean[0] + mean[1]) / 2.0;
  EXPECT_NEAR(r.loss, want, 1e-14);
  for (int64_t i = 0; i < in.bt; ++i) {
    EXPECT_EQ(r.ratio[i], 1.0) << i;
    // w_i = 1 / (B n_b) = 1/8: dl_dlogp = coef / w = (1/B) pg_b g_i / n_b * 8 = pg_b g_i.
    EXPECT_NEAR(r.dl_dlogp[i], i == 5 ? 0.0 : -mean[i / 4], 1e-14) << i;
  }
}

// A row whose log-ratio passes its advantage's bound (above eps_high with A > 0, below
// -eps_low with A < 0) is counted as clipped and passes no gradient; past the other bound it
// is not clipped (min keeps the unclamped value).
TEST(PolicyGeoMeanReferenceTest, ClippedRowsPassNoGradientAndAreCounted) {
  Inputs in(1, 4, 3, 6, 107);
  PolicyProblem p = in.Problem(false);
  p.options.loss_type = PolicyLossType::kGeoMean;
  p.options.beta = 0.0f;
  p.options.epsilon_low = 0.2f;
  p.options.epsilon_high = 0.3f;
  const std::vector<double> logp = in.CurrentLogprobs(p);
  // Log-ratios 0.5 (A > 0: clipped), 0.5 (A < 0: kept), -0.4 (A < 0: clipped), -0.4 (A > 0).
  const double d[4] = {0.5, 0.5, -0.4, -0.4};
  const float a[4] = {0.8f, -0.6f, -1.1f, 0.4f};
  for (int64_t i = 0; i < 4; ++i) {
    in.old_logp[i] = static_cast<float>(logp[i] - d[i]);
    in.advantages[i] = a[i];
  }
  const PolicyReferenceOutputs r = RunPolicyReference(p);
  EXPECT_NEAR(r.clip_fraction, 0.5, 1e-15);
  EXPECT_EQ(r.dl_dlogp[0], 0.0);
  EXPECT_EQ(r.dl_dlogp[2], 0.0);
  EXPECT_NE(r.dl_dlogp[1], 0.0);
  EXPECT_NE(r.dl_dlogp[3], 0.0);
  // R = exp((eps_high + d_1 - eps_low + d_3) / 4): the bounds are the fp32 epsilons, the kept
  // log-ratios those of the fp32 old log-probs.
  double e = 0;
  for (int64_t i = 0; i < 4; ++i) {
    const double di = logp[i] - static_cast<double>(in.old_logp[i]);
    e += i == 0 ? static_cast<double>(0.3f) : i == 2 ? -static_cast<double>(0.2f) : di;
  }
  const double abar = (static_cast<double>(a[0]) + a[1] + a[2] + a[3]) / 4.0;
  EXPECT_NEAR(r.loss, -abar * std::exp(e / 4.0), 1e-12);
  EXPECT_NEAR(r.ratio[0], std::exp(e / 4.0), 1e-12);
}

TEST(PolicyGeoMeanReferenceTest, RejectsSequenceLevelAndBiasCorrection) {
  Inputs in(2, 2, 3, 4, 109);
  PolicyProblem p = in.Problem(false);
  p.options.loss_type = PolicyLossType::kGeoMean;
  PolicyProblem q = p;
  q.options.importance_sampling = ImportanceSampling::kSequence;
  ExpectRefused(q, "do not apply to loss_type geo_mean");
  q = p;
  q.options.use_bias_correction_kl = true;
  ExpectRefused(q, "do not apply to loss_type geo_mean");
  q = p;
  q.options.delta = 2.0f;
  ExpectRefused(q, "options.delta applies to the clipped loss types; loss_type geo_mean");
}

}  // namespace
}  // namespace lossd
