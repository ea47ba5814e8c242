// SPDX-License-Identifier: Apache-2.0
// Tests of the float64 policy-loss reference's rollout correction is_ratio (Liger's
// vllm_is_ratio: a per-token factor on the policy term, not on the KL term): the gradient
// against central finite differences for every loss type at both importance-sampling levels,
// closed forms, and the refusals.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "gtest/gtest.h"
#include "core/dtype.h"
#include "kernels/cpu/policy_reference.h"
#include "kernels/cpu/reference_head.h"
#include "testing/cpu/policy_test_util.h"

namespace lossd {
namespace {

struct RhoCase {
  const char* name;
  PolicyLossType type;
  float epsilon_high;
  ImportanceSampling level;
};

constexpr RhoCase kRhoCases[] = {
    {"dapo", PolicyLossType::kDapo, 0.28f, ImportanceSampling::kToken},
    {"grpo", PolicyLossType::kGrpo, 0.28f, ImportanceSampling::kToken},
    {"cispo", PolicyLossType::kCispo, 1.3f, ImportanceSampling::kToken},
    {"sapo", PolicyLossType::kSapo, 0.28f, ImportanceSampling::kToken},
    {"luspo", PolicyLossType::kLuspo, 0.28f, ImportanceSampling::kToken},
    {"dapo_seq", PolicyLossType::kDapo, 0.28f, ImportanceSampling::kSequence},
    {"bnpo_seq", PolicyLossType::kBnpo, 0.28f, ImportanceSampling::kSequence},
};

// Per-token factors in [0.2, 2): some truncated-looking small ones, none zero.
std::vector<float> Rho(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(0.2f, 2.0f);
  std::vector<float> rho(n);
  for (float& e : rho) e = u(rng);
  return rho;
}

using FdParam = std::tuple<RhoCase, bool /*old*/, KlCase, bool /*bias correction*/,
                           bool /*mask*/>;

class PolicyIsRatioFiniteDifferenceTest : public ::testing::TestWithParam<FdParam> {};

TEST_P(PolicyIsRatioFiniteDifferenceTest, GradientMatchesFiniteDifferences) {
  const auto [rc, old, kl, bias_correction, masked] = GetParam();
  Inputs in(2, 4, 3, 6, 41);
  PolicyProblem p = in.Problem(true);
  PolicyOptions& o = p.options;
  o.loss_type = rc.type;
  o.importance_sampling = rc.level;
  o.epsilon_high = rc.epsilon_high;
  o.use_bias_correction_kl = bias_correction;
  o.temperature = 0.9f;
  o.beta = kl == kNoKl ? 0.0f : 0.3f;
  o.grad_scale = 0.75f;
  if (masked) {
    in.MaskUnread(1);
    in.MaskUnread(6);
  }
  const std::vector<float> rho = Rho(in.bt, 43);
  p.is_ratio = rho.data();
  const std::vector<double> logp = in.CurrentLogprobs(p);
  SetOldAndRefLogprobs(logp, 13, old, kl, &in, &p);
  PolicyReferenceOutputs r;
  ASSERT_TRUE(PolicyReference(p, &r).ok());
  const FrozenProblem fp(p, logp);
  // cispo's weight is detached: differenced with it frozen, as the types test does.
  std::vector<double> frozen_weight(in.bt, 0.0);
  std::vector<float> zero_advantages(in.bt, 0.0f);
  if (o.loss_type == PolicyLossType::kCispo) {
    const double n = masked ? 6 : 8;
    for (int64_t i = 0; i < in.bt; ++i) {
      frozen_weight[i] = in.mask[i] * rho[i] * -std::min(r.ratio[i], double{1.3f}) *
                         in.advantages[i] / n;
    }
  }
  auto objective = [&]() {
    if (o.loss_type != PolicyLossType::kCispo) return ScaledLoss(fp.q);
    PolicyProblem kl_only = fp.q;
    kl_only.advantages = zero_advantages.data();
    PolicyReferenceOutputs f;
    EXPECT_TRUE(PolicyReference(kl_only, &f).ok());
    double pg = 0;
    for (int64_t i = 0; i < in.bt; ++i) pg += frozen_weight[i] * f.logp[i];
    return static_cast<double>(o.grad_scale) * (f.loss + pg);
  };
  ExpectHeadGradientMatches(in, r.grad, true, objective);
  EXPECT_NEAR(objective(), o.grad_scale * r.loss, 1e-6);
}

std::string FdName(const ::testing::TestParamInfo<FdParam>& info) {
  const auto [rc, old, kl, bias_correction, masked] = info.param;
  return std::string(rc.name) + OldKlName(old, kl) + (bias_correction ? "_biascorr" : "") +
         MaskHeadName(masked, false);
}

INSTANTIATE_TEST_SUITE_P(
    AllOptions, PolicyIsRatioFiniteDifferenceTest,
    ::testing::Combine(::testing::ValuesIn(kRhoCases), ::testing::Bool(),
                       ::testing::Values(kNoKl, kKlWithRef), ::testing::Bool(),
                       ::testing::Bool()),
    FdName);

// One factor c on every token scales the policy term's loss and gradient by c and leaves the
// KL term (and both metrics) alone: with K the result at c = 0 (the KL term alone), the
// result at c is c (result at 1 - K) + K, at either importance-sampling level.
TEST(PolicyIsRatioReferenceTest, AConstantFactorScalesThePolicyTermOnly) {
  for (ImportanceSampling level : {ImportanceSampling::kToken, ImportanceSampling::kSequence}) {
    Inputs in(2, 4, 3, 6, 47);
    in.MaskUnread(3);
    PolicyProblem p = in.Problem(true);
    p.options.beta = 0.2f;
    p.options.importance_sampling = level;
    const std::vector<double> logp = in.CurrentLogprobs(p);
    SetOldAndRefLogprobs(logp, 5, true, kKlWithRef, &in, &p);
    PolicyReferenceOutputs one, scaled, kl_only;
    ASSERT_TRUE(PolicyReference(p, &one).ok());
    const std::vector<float> c(in.bt, 2.5f), zero(in.bt, 0.0f);
    p.is_ratio = c.data();
    ASSERT_TRUE(PolicyReference(p, &scaled).ok());
    p.is_ratio = zero.data();
    ASSERT_TRUE(PolicyReference(p, &kl_only).ok());
    EXPECT_NEAR(scaled.loss, 2.5 * (one.loss - kl_only.loss) + kl_only.loss, 1e-12);
    EXPECT_EQ(scaled.kl, one.kl);
    EXPECT_EQ(scaled.clip_fraction, one.clip_fraction);
    for (size_t k = 0; k < one.grad.dw.size(); ++k) {
      const double want = 2.5 * (one.grad.dw[k] - kl_only.grad.dw[k]) + kl_only.grad.dw[k];
      ASSERT_NEAR(scaled.grad.dw[k], want, 1e-12) << k;
    }
  }
}

TEST(PolicyIsRatioReferenceTest, RejectsBadFactors) {
  Inputs in(2, 2, 3, 4, 9);
  PolicyProblem p = in.Problem(false);
  std::vector<float> rho(in.bt, 1.0f);
  p.is_ratio = rho.data();
  PolicyReferenceOutputs ok;
  EXPECT_TRUE(PolicyReference(p, &ok).ok());
  rho[2] = -0.5f;
  ExpectRefused(p, "is_ratio[2] must be >= 0, got -0.5");
  rho[2] = NAN;
  ExpectRefused(p, "is_ratio");
}

}  // namespace
}  // namespace lossd
