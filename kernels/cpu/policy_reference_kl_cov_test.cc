// SPDX-License-Identifier: Apache-2.0
// Tests of the float64 policy-loss reference's kl_cov loss type (verl's KL-Cov: -A r on every
// token, plus ppo_kl_coef |logp - old| on the kl_cov_ratio share of the tokens with the largest
// covariance of A and logp): the gradient against central finite differences with the KL term,
// the entropy bonus, masks, the rollout correction and an aggregation; the tokens penalised
// are the largest covariances (closed form); the refusals.
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

// (beta 0 / KL with reference log-probs, entropy, mask, is_ratio, aggregation)
using KlCovParam = std::tuple<bool, bool, bool, bool, PolicyAggregation>;

class PolicyKlCovFiniteDifferenceTest : public ::testing::TestWithParam<KlCovParam> {};

// kl_cov_ratio 0.3 penalises 2 of 6-8 rows; a finite-difference step moves no covariance past
// another here (the covariances of the random inputs are far apart for their step), so the
// chosen rows are fixed and the loss smooth.
TEST_P(PolicyKlCovFiniteDifferenceTest, GradientMatchesFiniteDifferences) {
  const auto [kl, entropy, masked, rho, aggregation] = GetParam();
  Inputs in(2, 4, 3, 6, 113);
  PolicyProblem p = in.Problem(true);
  PolicyOptions& o = p.options;
  o.loss_type = PolicyLossType::kKlCov;
  o.kl_cov_ratio = 0.3;
  o.ppo_kl_coef = 0.7f;
  o.beta = kl ? 0.2f : 0.0f;
  o.entropy_coeff = entropy ? 0.15f : 0.0f;
  o.aggregation = aggregation;
  o.temperature = 0.9f;
  o.grad_scale = 1.25f;
  if (masked) in.MaskUnread(3);
  const std::vector<float> weights = {0.5f, 1.5f, 0.9f, 2.0f, 1.1f, 0.3f, 1.0f, 0.7f};
  if (rho) p.is_ratio = weights.data();
  const std::vector<double> logp = in.CurrentLogprobs(p);
  SetOldAndRefLogprobs(logp, 47, true, kl ? kKlWithRef : kNoKl, &in, &p);
  PolicyReferenceOutputs r;
  ASSERT_TRUE(PolicyReference(p, &r).ok());
  EXPECT_GT(r.clip_fraction, 0.0);  // some row penalised
  ExpectHeadGradientMatches(in, r.grad, true, [&]() { return ScaledLoss(p); });
}

std::string KlCovName(const ::testing::TestParamInfo<KlCovParam>& info) {
  const auto [kl, entropy, masked, rho, aggregation] = info.param;
  std::string agg = PolicyAggregationName(aggregation);
  for (char& c : agg) c = c == '-' ? '_' : c;
  return std::string(kl ? "kl" : "nokl") + (entropy ? "_entropy" : "") +
         (masked ? "_mask" : "") + (rho ? "_isratio" : "") + "_" + agg;
}

INSTANTIATE_TEST_SUITE_P(Options, PolicyKlCovFiniteDifferenceTest,
                         ::testing::Combine(::testing::Bool(), ::testing::Bool(),
                                            ::testing::Bool(), ::testing::Bool(),
                                            ::testing::Values(PolicyAggregation::kLossType,
                                                              PolicyAggregation::kSeqMeanTokenMean)),
                         KlCovName);

// The penalised rows are the k with the largest (A - mean A)(logp - mean logp), k = max(1,
// floor(N ratio)); the loss is dapo's mean of -A r plus c |d| on them.
TEST(PolicyKlCovReferenceTest, PenalisesTheLargestCovariances) {
  Inputs in(2, 4, 3, 7, 127);
  in.MaskUnread(5);
  PolicyProblem p = in.Problem(false);
  p.options.loss_type = PolicyLossType::kKlCov;
  p.options.beta = 0.0f;
  p.options.kl_cov_ratio = 0.3;  // floor(7 x 0.3) = 2 rows
  p.options.ppo_kl_coef = 2.0f;
  const std::vector<double> logp = in.CurrentLogprobs(p);
  SetOldAndRefLogprobs(logp, 53, true, kNoKl, &in, &p);
  const PolicyReferenceOutputs r = RunPolicyReference(p);
  double mean_a = 0, mean_l = 0, n = 0;
  for (int64_t i = 0; i < in.bt; ++i) {
    if (!in.mask[i]) continue;
    mean_a += in.advantages[i];
    mean_l += logp[i];
    n += 1;
  }
  mean_a /= n;
  mean_l /= n;
  std::vector<std::pair<double, int64_t>> cov;
  for (int64_t i = 0; i < in.bt; ++i) {
    if (in.mask[i]) cov.push_back({(in.advantages[i] - mean_a) * (logp[i] - mean_l), i});
  }
  std::sort(cov.rbegin(), cov.rend());
  std::vector<bool> chosen(in.bt, false);
  chosen[cov[0].second] = chosen[cov[1].second] = true;
  double want = 0;
  for (int64_t i = 0; i < in.bt; ++i) {
    if (!in.mask[i]) continue;
    const double d = logp[i] - in.old_logp[i];
    want += (-in.advantages[i] * std::exp(d) + (chosen[i] ? 2.0 * std::abs(d) : 0.0)) / n;
  }
  EXPECT_NEAR(r.loss, want, 1e-12);
  EXPECT_NEAR(r.clip_fraction, 2.0 / n, 1e-15);
  // The smallest ratio still penalises one row.
  PolicyProblem q = p;
  q.options.kl_cov_ratio = 1e-6;
  EXPECT_NEAR(RunPolicyReference(q).clip_fraction, 1.0 / n, 1e-15);
}

TEST(PolicyKlCovReferenceTest, RejectsBadOptions) {
  Inputs in(2, 2, 3, 4, 131);
  PolicyProblem p = in.Problem(false);
  p.options.loss_type = PolicyLossType::kKlCov;
  PolicyProblem q = p;
  q.options.kl_cov_ratio = 0;
  ExpectRefused(q, "options.kl_cov_ratio must be in (0, 1]");
  q = p;
  q.options.kl_cov_ratio = 1.5;
  ExpectRefused(q, "options.kl_cov_ratio must be in (0, 1]");
  q = p;
  q.options.ppo_kl_coef = -1.0f;
  ExpectRefused(q, "options.ppo_kl_coef finite and >= 0, got 0.0002 and -1");
  q = p;
  q.options.importance_sampling = ImportanceSampling::kSequence;
  ExpectRefused(q, "do not apply to loss_type kl_cov");
  q = p;
  q.options.delta = 2.0f;
  ExpectRefused(q, "options.delta applies to the clipped loss types; loss_type kl_cov");
}

}  // namespace
}  // namespace lossd
