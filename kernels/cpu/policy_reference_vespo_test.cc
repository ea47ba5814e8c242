// SPDX-License-Identifier: Apache-2.0
// Tests of the float64 policy-loss reference's vespo loss type (Liger's and TRL's: -phi A logp
// with phi a detached gamma weight of the sequence's summed log-ratio). phi is a constant of
// the gradient, so finite differences of vespo's own loss would not give it: the gradient is
// checked against the central differences of its twin with phi frozen, gpg (-A logp, dapo's
// normaliser) with advantages phi_i A_i, phi from Liger's formula (policy_test_util's); and the
// closed forms: phi(1) = 1 (no old log-probs: vespo is gpg), the weights by the advantage's
// sign, the rollout correction summed over every row (masked ones too) and not applied again,
// the clamps; the refusals.
#include <algorithm>
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

// vespo's twin with phi frozen: gpg with advantages phi_i A_i and no rollout correction
// (vespo's is inside phi). advantages: the twin's storage.
PolicyProblem FrozenTwin(const PolicyProblem& p, const std::vector<double>& phi,
                         std::vector<float>* advantages) {
  PolicyProblem q = p;
  advantages->resize(p.head.bt);
  for (int64_t i = 0; i < p.head.bt; ++i) {
    (*advantages)[i] = static_cast<float>(phi[i] * p.advantages[i]);
  }
  q.options.loss_type = PolicyLossType::kGpg;
  q.advantages = advantages->data();
  q.is_ratio = nullptr;
  return q;
}

// (KL estimator or none, bias correction, entropy, masked rows, is_ratio, aggregation)
using VespoParam = std::tuple<int /*-1: beta 0*/, bool, bool, bool, bool, PolicyAggregation>;

class PolicyVespoFiniteDifferenceTest : public ::testing::TestWithParam<VespoParam> {};

// The log-ratios (kFdRatios: -0.60 .. 0.41) put w away from 1 on both sides, so phi differs
// between the sequences and from 1, and both advantage signs occur in each sequence.
TEST_P(PolicyVespoFiniteDifferenceTest, GradientMatchesTheFrozenWeightsFiniteDifferences) {
  const auto [estimator, bias_kl, entropy, masked, rho, aggregation] = GetParam();
  Inputs in(2, 4, 3, 6, 113);
  PolicyProblem p = in.Problem(true);
  PolicyOptions& o = p.options;
  o.loss_type = PolicyLossType::kVespo;
  o.beta = estimator >= 0 ? 0.3f : 0.0f;
  if (estimator >= 0) o.kl_estimator = static_cast<KlEstimator>(estimator);
  o.use_bias_correction_kl = bias_kl;
  o.entropy_coeff = entropy ? 0.25f : 0.0f;
  o.aggregation = aggregation;
  o.temperature = 0.9f;
  o.grad_scale = 0.75f;
  o.vespo_k_pos = 1.5f;  // not the defaults, so a swapped pair shows
  o.vespo_lambda_neg = 2.5f;
  if (masked) in.MaskUnread(2);
  const std::vector<float> weights = {0.5f, 1.5f, 0.9f, 2.0f, 1.1f, 0.3f, 1.0f, 0.7f};
  if (rho) p.is_ratio = weights.data();
  const std::vector<double> logp = in.CurrentLogprobs(p);
  SetOldAndRefLogprobs(logp, 47, true, estimator >= 0 ? kKlWithRef : kNoKl, &in, &p);
  PolicyReferenceOutputs r;
  ASSERT_TRUE(PolicyReference(p, &r).ok());
  const std::vector<double> phi = VespoWeightsOf(p, logp, {}).phi;
  EXPECT_GT(std::fabs(phi[0] - phi[4]), 1e-3);  // the sequences' weights differ
  std::vector<float> twin_advantages;
  const PolicyProblem twin = FrozenTwin(p, phi, &twin_advantages);
  const PolicyReferenceOutputs t = RunPolicyReference(twin);
  // The twin's advantages are phi_i A_i rounded to fp32: its loss moves by at most half an
  // ulp of each, times |logp_i| (a row's weight is at most 1).
  double rounding = 0;
  for (int64_t i = 0; i < in.bt; ++i) rounding += std::fabs(twin_advantages[i] * logp[i]);
  EXPECT_NEAR(r.loss, t.loss, 0x1p-24 * rounding + 1e-15);
  EXPECT_EQ(r.clip_fraction, 0.0);
  ExpectHeadGradientMatches(in, r.grad, true, [&]() { return ScaledLoss(twin); });
}

std::string VespoName(const ::testing::TestParamInfo<VespoParam>& info) {
  const auto [estimator, bias_kl, entropy, masked, rho, aggregation] = info.param;
  std::string agg = PolicyAggregationName(aggregation);
  for (char& c : agg) c = c == '-' ? '_' : c;
  return std::string(estimator < 0 ? "nokl"
                                   : KlEstimatorName(static_cast<KlEstimator>(estimator))) +
         (bias_kl ? "_biaskl" : "") + (entropy ? "_entropy" : "") + (masked ? "_mask" : "") +
         (rho ? "_isratio" : "") + "_" + agg;
}

INSTANTIATE_TEST_SUITE_P(
    Options, PolicyVespoFiniteDifferenceTest,
    ::testing::Combine(::testing::Values(-1, static_cast<int>(KlEstimator::kK3)),
                       ::testing::Bool(), ::testing::Bool(), ::testing::Bool(),
                       ::testing::Bool(),
                       ::testing::Values(PolicyAggregation::kLossType,
                                         PolicyAggregation::kSeqMeanTokenMean)),
    VespoName);

// Without old log-probs every log-ratio is 0: w = 1, phi = exp(l + 0 - l) = 1, and vespo is gpg
// (-A logp over dapo's normaliser) in loss and gradient, whatever k and lambda.
TEST(PolicyVespoReferenceTest, WithoutOldLogprobsVespoIsGpg) {
  Inputs in(2, 4, 3, 6, 127);
  in.MaskUnread(5);
  PolicyProblem p = in.Problem(true);
  p.options.loss_type = PolicyLossType::kVespo;
  p.options.beta = 0.0f;
  p.options.vespo_k_neg = 7.0f;
  p.options.vespo_lambda_pos = 0.5f;
  p.old_logp = nullptr;
  PolicyProblem gpg = p;
  gpg.options.loss_type = PolicyLossType::kGpg;
  const PolicyReferenceOutputs v = RunPolicyReference(p), g = RunPolicyReference(gpg);
  EXPECT_NEAR(v.loss, g.loss, 1e-14);
  ExpectNearAll(v.dl_dlogp, g.dl_dlogp, 1e-14, "dl_dlogp");
  ExpectNearAll(v.grad.dx, g.grad.dx, 1e-14, "dx");
}

// The closed form at one sequence with hand-set log-ratios: u = sum of the counted rows'
// log-ratios plus every row's log rho (the masked row's too), phi by the advantage's sign, and
// rho not applied to the policy term again: loss = -sum_i m_i phi_i A_i logp_i / N.
TEST(PolicyVespoReferenceTest, WeightsFollowTheAdvantagesSignAndTheWholeSequencesRho) {
  Inputs in(1, 4, 3, 6, 131);
  in.MaskUnread(3);
  PolicyProblem p = in.Problem(false);
  p.options.loss_type = PolicyLossType::kVespo;
  p.options.beta = 0.0f;
  const std::vector<double> logp = in.CurrentLogprobs(p);
  const double d[3] = {0.3, -0.1, 0.45};
  const float a[3] = {0.7f, -1.2f, 0.4f};
  for (int64_t i = 0; i < 3; ++i) {
    in.old_logp[i] = static_cast<float>(logp[i] - d[i]);
    in.advantages[i] = a[i];
  }
  const std::vector<float> rho = {0.8f, 1.1f, 0.9f, 0.5f};  // row 3 masked, still summed
  p.is_ratio = rho.data();
  const PolicyReferenceOutputs r = RunPolicyReference(p);
  double u = 0;
  for (int64_t i = 0; i < 4; ++i) u += std::log(double{rho[i]});
  for (int64_t i = 0; i < 3; ++i) u += logp[i] - static_cast<double>(in.old_logp[i]);
  const double w = std::exp(u);
  const double phi_pos = std::exp(3.0 + 2.0 * u - 3.0 * w);  // (k, lambda) = (2, 3)
  const double phi_neg = std::exp(2.0 + 3.0 * u - 2.0 * w);  // (3, 2)
  double want = 0;
  for (int64_t i = 0; i < 3; ++i) want -= (a[i] >= 0 ? phi_pos : phi_neg) * a[i] * logp[i];
  EXPECT_NEAR(r.loss, want / 3.0, 1e-13 * std::fabs(want));
  EXPECT_NEAR(r.dl_dlogp[0], -phi_pos * a[0], 1e-13);
  EXPECT_NEAR(r.dl_dlogp[1], -phi_neg * a[1], 1e-13);
  EXPECT_EQ(r.dl_dlogp[3], 0.0);
}

// log w is clamped to [log 1e-8, 20] and each log rho to the same bounds (rho = 0 adds
// log 1e-8): far below, w = 1e-8 and phi = exp(l + k log 1e-8 - l 1e-8), tiny but not 0; far
// above, phi underflows to 0 and the rows pass nothing.
TEST(PolicyVespoReferenceTest, ClampsBoundTheWeight) {
  Inputs in(2, 2, 3, 6, 137);
  PolicyProblem p = in.Problem(false);
  p.options.loss_type = PolicyLossType::kVespo;
  p.options.beta = 0.0f;
  p.old_logp = nullptr;
  in.advantages = {0.5f, 0.9f, 0.6f, 1.0f};
  const std::vector<float> rho = {0.0f, 0.0f, 4e8f, 4e8f};  // log: -inf, -inf; 19.8, 19.8
  p.is_ratio = rho.data();
  const PolicyReferenceOutputs r = RunPolicyReference(p);
  const double lo = std::log(1e-8);
  const double phi_lo = std::exp(3.0 + 2.0 * lo - 3.0 * 1e-8);
  EXPECT_NEAR(r.dl_dlogp[0], -phi_lo * 0.5, 1e-12 * phi_lo);
  EXPECT_GT(phi_lo, 0.0);
  EXPECT_EQ(r.dl_dlogp[2], 0.0);  // exp(3 + 40 - 3 e^20) underflows
  EXPECT_EQ(r.dl_dlogp[3], 0.0);
}

TEST(PolicyVespoReferenceTest, RejectsSequenceLevelDeltaAndBadShapes) {
  Inputs in(2, 2, 3, 4, 139);
  PolicyProblem p = in.Problem(false);
  p.options.loss_type = PolicyLossType::kVespo;
  PolicyProblem q = p;
  q.options.importance_sampling = ImportanceSampling::kSequence;
  ExpectRefused(q, "options.importance_sampling sequence applies to the clipped loss types");
  q = p;
  q.options.delta = 2.0f;
  ExpectRefused(q, "loss_type vespo has no clipped surrogate");
  q = p;
  q.options.vespo_lambda_neg = -1.0f;
  ExpectRefused(q, "options.vespo_lambda_pos and _lambda_neg finite and >= 0");
  q = p;
  q.options.vespo_k_pos = NAN;
  ExpectRefused(q, "options.vespo_k_pos and _k_neg must be finite");
}

}  // namespace
}  // namespace lossd
