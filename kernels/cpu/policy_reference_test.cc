// SPDX-License-Identifier: Apache-2.0
// Tests of the float64 policy-loss reference: the gradient against central finite differences
// of its own loss for every combination of loss type, old log-probs, KL term, temperature,
// mask and head options; and hand-checkable cases (the normalisations in closed form, clipped
// tokens giving no gradient, the KL term and Liger's metrics, an all-masked batch).
#include "kernels/cpu/policy_reference.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "gtest/gtest.h"
#include "core/dtype.h"
#include "kernels/cpu/logprob_reference.h"
#include "kernels/cpu/reference_head.h"
#include "testing/cpu/policy_test_util.h"

namespace lossd {
namespace {

struct LossCase {
  const char* name;
  PolicyLossType type;
  double dapo_normalizer;
};

using FdParam = std::tuple<LossCase, bool /*old*/, KlCase, float /*temperature*/,
                           bool /*mask*/, bool /*bias and softcap*/>;

class PolicyFiniteDifferenceTest : public ::testing::TestWithParam<FdParam> {};

TEST_P(PolicyFiniteDifferenceTest, GradientMatchesFiniteDifferences) {
  const auto [loss_case, old, kl, temperature, masked, head_options] = GetParam();
  Inputs in(2, 4, 3, 6, 17);
  PolicyProblem p = in.Problem(head_options);
  PolicyOptions& o = p.options;
  o.loss_type = loss_case.type;
  o.dapo_normalizer = loss_case.dapo_normalizer;
  o.max_completion_length = 7;
  o.epsilon_low = 0.2f;
  o.epsilon_high = 0.28f;
  o.temperature = temperature;
  o.softcap = head_options ? 2.5f : 0.0f;
  o.beta = kl == kNoKl ? 0.0f : 0.3f;
  o.grad_scale = 0.75f;
  if (masked) {
    in.MaskUnread(2);
    in.MaskUnread(5);
  }
  const std::vector<double> logp = in.CurrentLogprobs(p);
  SetOldAndRefLogprobs(logp, 5, old, kl, &in, &p);

  PolicyReferenceOutputs r;
  ASSERT_TRUE(PolicyReference(p, &r).ok());
  EXPECT_EQ(r.tokens, masked ? 6 : 8);
  EXPECT_EQ(r.has_kl, kl != kNoKl);
  int64_t clipped = 0;
  for (int64_t i = 0; i < in.bt; ++i) {
    if (in.mask[i] == 0) continue;
    EXPECT_NEAR(r.logp[i], logp[i], 1e-15);
    const double ratio = old ? kFdRatios[i] : 1.0;
    ASSERT_NEAR(r.ratio[i], ratio, 1e-5);
    const bool c = (ratio < 0.8 && in.advantages[i] < 0) || (ratio > 1.28 && in.advantages[i] > 0);
    clipped += c ? 1 : 0;
  }
  // Liger's metric, and the premise that some tokens are clipped and some are not.
  EXPECT_DOUBLE_EQ(r.clip_fraction, static_cast<double>(clipped) / r.tokens);
  if (old) {
    ASSERT_GT(clipped, 0);
    ASSERT_LT(clipped, r.tokens);
  }
  ExpectKlMetric(r, kl);

  // Without old (reference) log-probs they are the current ones detached, frozen for the
  // finite differences (fp32-rounded: r = 1 within 1e-7, far inside the bounds).
  const FrozenProblem fp(p, logp);
  ExpectHeadGradientMatches(in, r.grad, head_options, [&] { return ScaledLoss(fp.q); });
  if (masked) {
    for (int64_t k = 0; k < in.h; ++k) EXPECT_EQ(r.grad.dx[2 * in.h + k], 0.0);
    for (int64_t k = 0; k < in.h; ++k) EXPECT_EQ(r.grad.dx[5 * in.h + k], 0.0);
  }
}

constexpr LossCase kLossCases[] = {
    {"dapo", PolicyLossType::kDapo, 0},
    {"dapo_given_normalizer", PolicyLossType::kDapo, 11.5},
    {"grpo", PolicyLossType::kGrpo, 0},
    {"bnpo", PolicyLossType::kBnpo, 0},
    {"dr_grpo", PolicyLossType::kDrGrpo, 0},
};

std::string FdName(const ::testing::TestParamInfo<FdParam>& info) {
  const auto [loss_case, old, kl, temperature, masked, head_options] = info.param;
  return std::string(loss_case.name) + OldKlName(old, kl) + (temperature == 1.0f ? "_T1" : "_T08") +
         MaskHeadName(masked, head_options);
}

INSTANTIATE_TEST_SUITE_P(
    AllOptions, PolicyFiniteDifferenceTest,
    ::testing::Combine(::testing::ValuesIn(kLossCases), ::testing::Bool(),
                       ::testing::Values(kNoKl, kKlWithRef, kBetaWithoutRef),
                       ::testing::Values(1.0f, 0.8f), ::testing::Bool(), ::testing::Bool()),
    FdName);

// Without old log-probs r = 1 (never clipped) and with beta 0 every token's loss is -A_i, so
// each normalisation has a closed form in the advantages alone; sequence 1 is fully masked
// (grpo still divides by B), sequence 2 partly. The gradient is the logprob reference's with
// dlogp_i = -grad_scale w_i A_i.
TEST(PolicyReferenceTest, NormalisationsInClosedForm) {
  Inputs in(3, 4, 5, 7, 23);
  for (int64_t i = 4; i < 8; ++i) in.mask[i] = 0;
  in.mask[9] = in.mask[11] = 0;
  const double a = in.advantages[0] + in.advantages[1] + in.advantages[2] + in.advantages[3];
  const double c = in.advantages[8] + in.advantages[10];
  const double n = 6, b = 3, lmax = 9;
  const struct {
    PolicyLossType type;
    double normalizer, loss;
    std::vector<double> w;  // per sequence: row weight
  } cases[] = {
      {PolicyLossType::kDapo, 0, -(a + c) / n, {1 / n, 0, 1 / n}},
      {PolicyLossType::kDapo, 0.5, -(a + c), {1, 0, 1}},  // D clamped to 1, as Liger does
      {PolicyLossType::kDapo, 40, -(a + c) / 40, {1 / 40.0, 0, 1 / 40.0}},
      {PolicyLossType::kBnpo, 0, -(a + c) / n, {1 / n, 0, 1 / n}},
      {PolicyLossType::kGrpo, 0, -(a / 4 + c / 2) / b, {1 / (4 * b), 0, 1 / (2 * b)}},
      {PolicyLossType::kDrGrpo, 0, -(a + c) / (b * lmax), {1 / (b * lmax), 0, 1 / (b * lmax)}},
  };
  for (const auto& k : cases) {
    PolicyProblem p = in.Problem(true);
    p.old_logp = nullptr;
    p.options.loss_type = k.type;
    p.options.dapo_normalizer = k.normalizer;
    p.options.max_completion_length = 9;
    p.options.beta = 0.0f;
    p.options.grad_scale = 1.5f;
    p.options.temperature = 0.9f;
    PolicyReferenceOutputs r;
    ASSERT_TRUE(PolicyReference(p, &r).ok());
    const std::string what = PolicyLossTypeName(k.type);
    EXPECT_NEAR(r.loss, k.loss, 1e-15) << what;
    EXPECT_EQ(r.tokens, 6);
    EXPECT_EQ(r.clip_fraction, 0.0);
    EXPECT_FALSE(r.has_kl);

    std::vector<float> dlogp(in.bt);
    for (int64_t i = 0; i < in.bt; ++i) {
      dlogp[i] = static_cast<float>(-1.5 * k.w[i / 4] * in.advantages[i] * in.mask[i]);
    }
    LogprobProblem lp;
    lp.head = p.head;
    lp.targets = p.targets;
    lp.dlogp = dlogp.data();
    lp.options.temperature = 0.9f;
    LogprobReferenceOutputs expected;
    ASSERT_TRUE(LogprobReference(lp, &expected).ok());
    // dlogp was rounded to fp32 (relative 2^-24 per row).
    ExpectNearAll(r.grad.dx, expected.grad.dx, 1e-6, "dx");
    ExpectNearAll(r.grad.dw, expected.grad.dw, 1e-6, "dw");
    ExpectNearAll(r.grad.db, expected.grad.db, 1e-6, "db");
  }
}

// A token whose ratio is clipped (r > 1 + eps_high with A > 0, r < 1 - eps_low with A < 0)
// gives exactly no gradient, as Liger's min/clamp does; one below 1 - eps_low with A > 0 is not
// clipped (the min picks r A) and does.
TEST(PolicyReferenceTest, ClippedTokensGiveNoGradient) {
  Inputs in(1, 4, 3, 5, 31);
  PolicyProblem p = in.Problem(true);
  p.options.beta = 0.0f;
  p.options.epsilon_low = 0.2f;
  p.options.epsilon_high = 0.3f;
  const std::vector<double> logp = in.CurrentLogprobs(p);
  const double ratios[4] = {1.6, 0.5, 2.0, 0.7};
  const float adv[4] = {0.8f, -0.6f, 1.1f, -0.9f};
  for (int i = 0; i < 4; ++i) {
    in.old_logp[i] = static_cast<float>(logp[i] - std::log(ratios[i]));
    in.advantages[i] = adv[i];
  }
  PolicyReferenceOutputs r;
  ASSERT_TRUE(PolicyReference(p, &r).ok());
  EXPECT_EQ(r.clip_fraction, 1.0);
  for (double g : r.grad.dx) ASSERT_EQ(g, 0.0);
  for (double g : r.grad.dw) ASSERT_EQ(g, 0.0);
  for (double g : r.grad.db) ASSERT_EQ(g, 0.0);
  // The loss is the clipped one: -(1.3 * 0.8 + 0.8 * -0.6 + 1.3 * 1.1 + 0.8 * -0.9) / 4 (dapo).
  const double hi = 1.0 + 0.3f, lo = 1.0 - 0.2f;
  EXPECT_NEAR(r.loss, -(hi * adv[0] + lo * adv[1] + hi * adv[2] + lo * adv[3]) / 4, 1e-15);

  // Token 1 (r = 0.5) with a positive advantage: not clipped, its -A r gradient flows.
  in.advantages[1] = 0.6f;
  ASSERT_TRUE(PolicyReference(p, &r).ok());
  EXPECT_EQ(r.clip_fraction, 0.75);
  double norm = 0;
  for (double g : r.grad.dx) norm = std::max(norm, std::fabs(g));
  EXPECT_GT(norm, 1e-3);
  for (int64_t i = 0; i < 4; ++i) {
    for (int64_t k = 0; k < in.h; ++k) {
      if (i != 1) {
        EXPECT_EQ(r.grad.dx[i * in.h + k], 0.0) << i;
      }
    }
  }
}

// Without old log-probs r = 1 exactly; with eps_low = 0 (or both 0) it sits on a clip bound,
// where torch's clamp passes no gradient and min splits its tie: half the gradient, exactly,
// of the same problem with r strictly inside. Not clipped, the loss is unchanged.
TEST(PolicyReferenceTest, RatioOnABoundGetsHalfTheGradient) {
  Inputs in(2, 3, 4, 5, 37);
  PolicyProblem p = in.Problem(true);
  p.old_logp = nullptr;
  p.options.beta = 0.0f;
  PolicyReferenceOutputs inside, on_low, on_both;
  ASSERT_TRUE(PolicyReference(p, &inside).ok());
  p.options.epsilon_low = 0.0f;
  ASSERT_TRUE(PolicyReference(p, &on_low).ok());
  p.options.epsilon_high = 0.0f;
  ASSERT_TRUE(PolicyReference(p, &on_both).ok());
  for (const PolicyReferenceOutputs* r : {&on_low, &on_both}) {
    EXPECT_EQ(r->loss, inside.loss);
    EXPECT_EQ(r->clip_fraction, 0.0);
    ASSERT_EQ(r->grad.dx.size(), inside.grad.dx.size());
    for (size_t k = 0; k < inside.grad.dx.size(); ++k) {
      EXPECT_EQ(2 * r->grad.dx[k], inside.grad.dx[k]) << k;  // halving is exact
    }
    for (size_t k = 0; k < inside.grad.dw.size(); ++k) {
      EXPECT_EQ(2 * r->grad.dw[k], inside.grad.dw[k]) << k;
    }
  }
  double norm = 0;
  for (double g : inside.grad.dx) norm = std::max(norm, std::fabs(g));
  EXPECT_GT(norm, 1e-3);
}

// The k3 KL term and Liger's metrics with old log-probs absent (r = 1): per token
// -A_i + beta (exp(ref_i - logp_i) - (ref_i - logp_i) - 1); the KL metric over N whatever the
// loss type; beta 0 drops the term and the metric even with reference log-probs given.
TEST(PolicyReferenceTest, KlTermAndMetric) {
  Inputs in(2, 3, 4, 6, 41);
  in.mask[4] = 0;
  PolicyProblem p = in.Problem(false);
  p.old_logp = nullptr;
  p.options.loss_type = PolicyLossType::kGrpo;
  p.options.beta = 0.25f;
  const std::vector<double> logp = in.CurrentLogprobs(p);
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> shift(-1.0f, 1.0f);
  for (int64_t i = 0; i < in.bt; ++i) in.ref_logp[i] = static_cast<float>(logp[i]) + shift(rng);
  PolicyReferenceOutputs r;
  ASSERT_TRUE(PolicyReference(p, &r).ok());
  double kl_sum = 0, loss = 0;
  for (int64_t i = 0; i < in.bt; ++i) {
    if (in.mask[i] == 0) continue;
    const double d = in.ref_logp[i] - logp[i];
    const double k3 = std::exp(d) - d - 1;
    kl_sum += k3;
    loss += (-in.advantages[i] + 0.25f * k3) / (2.0 * (i < 3 ? 3 : 2));
  }
  EXPECT_TRUE(r.has_kl);
  EXPECT_NEAR(r.kl, kl_sum / 5, 1e-14);
  EXPECT_NEAR(r.loss, loss, 1e-14);
  EXPECT_GT(kl_sum, 1e-2);
  p.options.beta = 0.0f;
  ASSERT_TRUE(PolicyReference(p, &r).ok());
  EXPECT_FALSE(r.has_kl);
  EXPECT_EQ(r.kl, 0.0);
  double pg = 0;
  for (int64_t i = 0; i < in.bt; ++i) {
    if (in.mask[i] != 0) pg += -in.advantages[i] / (2.0 * (i < 3 ? 3 : 2));
  }
  EXPECT_NEAR(r.loss, pg, 1e-15);
}

TEST(PolicyReferenceTest, AllMaskedGivesZeros) {
  Inputs in(2, 2, 3, 4, 2);
  in.mask.assign(in.bt, 0);
  for (PolicyLossType type : {PolicyLossType::kDapo, PolicyLossType::kGrpo,
                              PolicyLossType::kBnpo, PolicyLossType::kDrGrpo}) {
    PolicyProblem p = in.Problem(true);
    p.options.loss_type = type;
    p.options.max_completion_length = 2;
    PolicyReferenceOutputs r;
    ASSERT_TRUE(PolicyReference(p, &r).ok());
    EXPECT_EQ(r.loss, 0.0);
    EXPECT_EQ(r.kl, 0.0);
    EXPECT_EQ(r.clip_fraction, 0.0);
    EXPECT_EQ(r.tokens, 0);
    for (double g : r.grad.dx) ASSERT_EQ(g, 0.0);
    for (double g : r.grad.dw) ASSERT_EQ(g, 0.0);
  }
}

TEST(PolicyReferenceTest, DefaultsAreLigers) {
  const PolicyOptions o;
  EXPECT_EQ(o.loss_type, PolicyLossType::kDapo);
  EXPECT_EQ(o.epsilon_low, 0.2f);
  EXPECT_EQ(o.epsilon_high, 0.2f);
  EXPECT_EQ(o.beta, 0.04f);
  EXPECT_EQ(o.temperature, 1.0f);
}

TEST(PolicyReferenceTest, RejectsBadInput) {
  Inputs in(2, 2, 3, 4, 9);
  PolicyProblem p = in.Problem(false);
  PolicyReferenceOutputs ok;
  ASSERT_TRUE(PolicyReference(p, &ok).ok());
  p.options.loss_type = PolicyLossType::kDrGrpo;
  ExpectRefused(p, "options.max_completion_length must be > 0 with loss_type dr_grpo");
  p = in.Problem(false);
  p.options.epsilon_low = -0.1f;
  ExpectRefused(p, "options.epsilon_low must be finite and >= 0, got -0.1");
  p = in.Problem(false);
  p.options.beta = NAN;
  ExpectRefused(p, "options.beta");
  p = in.Problem(false);
  p.options.temperature = -1.0f;
  ExpectRefused(p, "options.temperature must be finite and > 0, got -1");
  p = in.Problem(false);
  p.options.dapo_normalizer = -2;
  ExpectRefused(p, "options.dapo_normalizer must be finite and >= 0");
  p = in.Problem(false);
  p.batch = 3;
  ExpectRefused(p, "batch must be > 0 and divide the row count 4, got 3");
  p = in.Problem(false);
  in.mask[1] = 2;
  ExpectRefused(p, "mask[1] must be 0 or 1, got 2");
  in.mask[1] = 0;
  in.targets[1] = -100;
  ASSERT_TRUE(PolicyReference(p, &ok).ok());  // a masked row's target is not read
  in.mask[1] = 1;
  ExpectRefused(p, "targets[1] = -100 is outside [0, 4) on a row whose mask is 1");
  in.targets[1] = 0;
  in.old_logp[3] = NAN;
  ExpectRefused(p, "old_logp[3] must be finite");
  in.old_logp[3] = 0;
  p.advantages = nullptr;
  ExpectRefused(p, "advantages must be non-null");
}

}  // namespace
}  // namespace lossd
