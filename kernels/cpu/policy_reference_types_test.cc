// SPDX-License-Identifier: Apache-2.0
// Tests of the float64 policy-loss reference's loss types cispo, sapo and luspo and its options
// delta and use_bias_correction_kl: the gradient against central finite differences for every
// combination of those with old log-probs, KL term, mask and head options; and hand-checkable
// cases (each new formula in closed form, delta's cap, the bias-corrected KL and its metric).
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
#include "kernels/cpu/policy_reference.h"
#include "kernels/cpu/reference_head.h"
#include "testing/cpu/policy_test_util.h"

namespace lossd {
namespace {

// A loss type with the options it is differenced under. cispo's bound is eps_high itself
// (1.3 here: kFdRatios land on both sides of it); delta 1.35 caps kFdRatios[3] = 1.45,
// a token with A < 0, and sits > 1 + eps_high = 1.28 as it must.
struct TypeCase {
  const char* name;
  PolicyLossType type;
  float epsilon_high;
  float delta;
};

constexpr TypeCase kTypeCases[] = {
    {"cispo", PolicyLossType::kCispo, 1.3f, 0.0f},
    {"cispo_clamp", PolicyLossType::kCispoClamp, 0.28f, 0.0f},  // clamped to [0.8, 1.28]
    {"sapo", PolicyLossType::kSapo, 0.28f, 0.0f},
    {"luspo", PolicyLossType::kLuspo, 0.28f, 0.0f},
    {"luspo_delta", PolicyLossType::kLuspo, 0.28f, 1.35f},
    {"dapo_delta", PolicyLossType::kDapo, 0.28f, 1.35f},
    {"grpo_delta", PolicyLossType::kGrpo, 0.28f, 1.35f},
};

using FdParam = std::tuple<TypeCase, bool /*old*/, KlCase, bool /*bias correction*/,
                           bool /*mask*/, bool /*bias and softcap*/>;

class PolicyTypesFiniteDifferenceTest : public ::testing::TestWithParam<FdParam> {};

// The objective finite differences see. cispo's weight min(r, eps_high) (cispo_clamp's
// clamp(r, 1 - eps_low, 1 + eps_high)) is detached, so its gradient is not its loss's: it is
// differenced as -sum_i w_i sg_i A_i logp_i (sg_i frozen at the reference's ratios) plus the
// loss with A = 0 (the KL term alone, with its live ratio).
bool DetachedWeight(PolicyLossType t) {
  return t == PolicyLossType::kCispo || t == PolicyLossType::kCispoClamp;
}

double Objective(const PolicyProblem& q, const std::vector<double>& frozen_weight,
                 const std::vector<float>& zero_advantages) {
  if (!DetachedWeight(q.options.loss_type)) return ScaledLoss(q);
  PolicyProblem kl_only = q;
  kl_only.advantages = zero_advantages.data();
  PolicyReferenceOutputs f;
  EXPECT_TRUE(PolicyReference(kl_only, &f).ok());
  double pg = 0;
  for (size_t i = 0; i < frozen_weight.size(); ++i) pg += frozen_weight[i] * f.logp[i];
  return static_cast<double>(q.options.grad_scale) * (f.loss + pg);
}

TEST_P(PolicyTypesFiniteDifferenceTest, GradientMatchesFiniteDifferences) {
  const auto [type_case, old, kl, bias_correction, masked, head_options] = GetParam();
  Inputs in(2, 4, 3, 6, 19);
  PolicyProblem p = in.Problem(head_options);
  PolicyOptions& o = p.options;
  o.loss_type = type_case.type;
  o.epsilon_low = 0.2f;
  o.epsilon_high = type_case.epsilon_high;
  o.delta = type_case.delta;
  o.sapo_temperature_pos = 1.7f;
  o.sapo_temperature_neg = 0.6f;
  o.use_bias_correction_kl = bias_correction;
  o.temperature = 0.8f;
  o.softcap = head_options ? 2.5f : 0.0f;
  o.beta = kl == kNoKl ? 0.0f : 0.3f;
  o.grad_scale = 0.75f;
  if (masked) {
    in.MaskUnread(2);
    in.MaskUnread(5);
  }
  const std::vector<double> logp = in.CurrentLogprobs(p);
  SetOldAndRefLogprobs(logp, 7, old, kl, &in, &p);

  PolicyReferenceOutputs r;
  ASSERT_TRUE(PolicyReference(p, &r).ok());
  EXPECT_EQ(r.tokens, masked ? 6 : 8);
  ExpectKlMetric(r, kl);

  // As policy_reference_test: absent old / reference log-probs are the current ones, frozen.
  const FrozenProblem fp(p, logp);
  std::vector<float> zero_advantages(in.bt, 0.0f);
  std::vector<double> frozen_weight(in.bt, 0.0);
  if (DetachedWeight(o.loss_type)) {
    const double n = masked ? 6 : 8;  // dapo's normaliser, the mask count
    for (int64_t i = 0; i < in.bt; ++i) {
      const double w = o.loss_type == PolicyLossType::kCispo
                           ? std::min(r.ratio[i], static_cast<double>(1.3f))
                           : std::clamp(r.ratio[i], 1.0 - static_cast<double>(0.2f),
                                        1.0 + static_cast<double>(0.28f));
      frozen_weight[i] = in.mask[i] * -w * in.advantages[i] / n;
    }
  }
  auto objective = [&]() { return Objective(fp.q, frozen_weight, zero_advantages); };
  ExpectHeadGradientMatches(in, r.grad, head_options, objective);
  // ... and the objective's value is the reference's loss (for cispo too), up to the fp32
  // rounding of the frozen log-probs (r = 1 within 1e-7 there).
  EXPECT_NEAR(objective(), o.grad_scale * r.loss, 1e-6);
}

std::string FdName(const ::testing::TestParamInfo<FdParam>& info) {
  const auto [type_case, old, kl, bias_correction, masked, head_options] = info.param;
  return std::string(type_case.name) + OldKlName(old, kl) + (bias_correction ? "_biascorr" : "") +
         MaskHeadName(masked, head_options);
}

INSTANTIATE_TEST_SUITE_P(
    AllOptions, PolicyTypesFiniteDifferenceTest,
    ::testing::Combine(::testing::ValuesIn(kTypeCases), ::testing::Bool(),
                       ::testing::Values(kNoKl, kKlWithRef, kBetaWithoutRef), ::testing::Bool(),
                       ::testing::Bool(), ::testing::Bool()),
    FdName);

// The logprob reference's gradient for upstream dlogp (what every policy gradient reduces to).
HeadGradients LogprobGradient(const PolicyProblem& p, const std::vector<double>& dlogp) {
  std::vector<float> d(dlogp.begin(), dlogp.end());
  LogprobProblem lp;
  lp.head = p.head;
  lp.targets = p.targets;
  lp.dlogp = d.data();
  lp.options.temperature = p.options.temperature;
  lp.options.ignore_index = -1;
  LogprobReferenceOutputs r;
  EXPECT_TRUE(LogprobReference(lp, &r).ok());
  return r.grad;
}

void ExpectGradientOf(const PolicyProblem& p, const PolicyReferenceOutputs& r,
                      const std::vector<double>& dlogp) {
  const HeadGradients want = LogprobGradient(p, dlogp);
  // dlogp is rounded to fp32 for the logprob reference (relative 2^-24 per row).
  ExpectNearAll(r.grad.dx, want.dx, 1e-6, "dx");
  ExpectNearAll(r.grad.dw, want.dw, 1e-6, "dw");
}

// Ratios of the hand cases: none within fp32 rounding of a bound (0.8, 1.2, 1.3).
constexpr double kHandRatios[8] = {0.55, 0.9, 1.1, 1.45, 0.7, 1.15, 0.95, 1.5};

// Each new type in closed form, beta 0, with old log-probs at known ratios; masked row 2.
struct HandCase {
  Inputs in{2, 4, 3, 6, 53};
  std::vector<double> logp;
  PolicyProblem p;
  explicit HandCase(PolicyLossType type) {
    in.mask[2] = 0;
    p = in.Problem(true);
    p.options.loss_type = type;
    p.options.beta = 0.0f;
    p.options.grad_scale = 1.25f;
    logp = in.CurrentLogprobs(p);
    for (int64_t i = 0; i < in.bt; ++i) {
      in.old_logp[i] = static_cast<float>(logp[i] - std::log(kHandRatios[i]));
    }
  }
  double Ratio(int64_t i) const { return std::exp(logp[i] - in.old_logp[i]); }
};

// cispo: -min(r, eps_high) A logp over the mask count, the weight detached; clipped where
// r > eps_high and A > 0 (eps_high = 1.3: rows 3 and 7, of which row 7 has A > 0).
TEST(PolicyTypesReferenceTest, CispoInClosedForm) {
  HandCase h(PolicyLossType::kCispo);
  h.p.options.epsilon_high = 1.3f;
  PolicyReferenceOutputs r;
  ASSERT_TRUE(PolicyReference(h.p, &r).ok());
  double loss = 0;
  int clipped = 0;
  std::vector<double> dlogp(h.in.bt, 0.0);
  for (int64_t i = 0; i < h.in.bt; ++i) {
    if (h.in.mask[i] == 0) continue;
    const double w = std::min(h.Ratio(i), static_cast<double>(1.3f));
    loss += -w * h.in.advantages[i] * h.logp[i] / 7;
    dlogp[i] = -1.25 * w * h.in.advantages[i] / 7;
    clipped += h.Ratio(i) > 1.3f && h.in.advantages[i] > 0 ? 1 : 0;
  }
  EXPECT_NEAR(r.loss, loss, 1e-14);
  EXPECT_EQ(clipped, 1);
  EXPECT_DOUBLE_EQ(r.clip_fraction, clipped / 7.0);
  ExpectGradientOf(h.p, r, dlogp);
}

// cispo_clamp (verl's cispo): -clamp(r, 1 - eps_low, 1 + eps_high) A logp over the mask
// count, the weight detached; clipped wherever the clamp holds, either sign of A (bounds 0.8
// and 1.2: rows 0, 3, 4 and 7 of the seven counted).
TEST(PolicyTypesReferenceTest, CispoClampInClosedForm) {
  HandCase h(PolicyLossType::kCispoClamp);
  PolicyReferenceOutputs r;
  ASSERT_TRUE(PolicyReference(h.p, &r).ok());
  double loss = 0;
  int clipped = 0;
  std::vector<double> dlogp(h.in.bt, 0.0);
  const double lo = 1.0 - static_cast<double>(0.2f), hi = 1.0 + static_cast<double>(0.2f);
  for (int64_t i = 0; i < h.in.bt; ++i) {
    if (h.in.mask[i] == 0) continue;
    const double w = std::clamp(h.Ratio(i), lo, hi);
    loss += -w * h.in.advantages[i] * h.logp[i] / 7;
    dlogp[i] = -1.25 * w * h.in.advantages[i] / 7;
    clipped += h.Ratio(i) < lo || h.Ratio(i) > hi ? 1 : 0;
  }
  EXPECT_NEAR(r.loss, loss, 1e-14);
  EXPECT_EQ(clipped, 4);
  EXPECT_DOUBLE_EQ(r.clip_fraction, clipped / 7.0);
  ExpectGradientOf(h.p, r, dlogp);
}

// sapo: -A (4 / tau) sigmoid(tau (r - 1)) with tau by A's sign, grpo's normalisation; the
// gradient -4 A r g (1 - g); no clip metric.
TEST(PolicyTypesReferenceTest, SapoInClosedForm) {
  HandCase h(PolicyLossType::kSapo);
  h.p.options.sapo_temperature_pos = 2.0f;
  h.p.options.sapo_temperature_neg = 0.5f;
  h.p.options.epsilon_high = 0.01f;  // would clip nearly everything if it applied
  PolicyReferenceOutputs r;
  ASSERT_TRUE(PolicyReference(h.p, &r).ok());
  double loss = 0;
  std::vector<double> dlogp(h.in.bt, 0.0);
  for (int64_t i = 0; i < h.in.bt; ++i) {
    if (h.in.mask[i] == 0) continue;
    const double a = h.in.advantages[i], ratio = h.Ratio(i);
    const double tau = a > 0 ? 2.0 : 0.5;
    const double g = 1 / (1 + std::exp(-tau * (ratio - 1)));
    const double n = i < 4 ? 3 : 4;  // sequence 0 has row 2 masked
    loss += -a * 4 / tau * g / (2 * n);
    dlogp[i] = -1.25 * 4 * a * ratio * g * (1 - g) / (2 * n);
  }
  EXPECT_NEAR(r.loss, loss, 1e-14);
  EXPECT_EQ(r.clip_fraction, 0.0);
  ExpectGradientOf(h.p, r, dlogp);
}

// luspo: the clipped surrogate, each token times its sequence's mask count, over B S.
TEST(PolicyTypesReferenceTest, LuspoInClosedForm) {
  HandCase h(PolicyLossType::kLuspo);
  PolicyReferenceOutputs r;
  ASSERT_TRUE(PolicyReference(h.p, &r).ok());
  double loss = 0;
  int clipped = 0;
  std::vector<double> dlogp(h.in.bt, 0.0);
  const double lo = 1.0 - static_cast<double>(0.2f), hi = 1.0 + static_cast<double>(0.2f);
  for (int64_t i = 0; i < h.in.bt; ++i) {
    if (h.in.mask[i] == 0) continue;
    const double a = h.in.advantages[i], ratio = h.Ratio(i);
    const double n = i < 4 ? 3 : 4;
    const bool c = (ratio < lo && a < 0) || (ratio > hi && a > 0);
    loss += -std::min(ratio * a, std::clamp(ratio, lo, hi) * a) * n / 8;
    dlogp[i] = c ? 0.0 : -1.25 * a * ratio * n / 8;
    clipped += c ? 1 : 0;
  }
  EXPECT_NEAR(r.loss, loss, 1e-14);
  EXPECT_GT(clipped, 0);
  EXPECT_DOUBLE_EQ(r.clip_fraction, clipped / 7.0);
  ExpectGradientOf(h.p, r, dlogp);
}

// delta caps r for the surrogate: a token with A < 0 and r > delta loses its gradient and its
// loss is -delta A; below delta nothing changes; the clip metric takes r before the cap.
TEST(PolicyTypesReferenceTest, DeltaCapsTheRatio) {
  HandCase h(PolicyLossType::kBnpo);
  PolicyReferenceOutputs plain, capped;
  ASSERT_TRUE(PolicyReference(h.p, &plain).ok());
  h.p.options.delta = 1.3f;  // rows 3 (A < 0, r 1.45) and 7 (A > 0, r 1.5, clipped anyway)
  ASSERT_TRUE(PolicyReference(h.p, &capped).ok());
  ASSERT_LT(h.in.advantages[3], 0.0f);
  ASSERT_GT(h.in.advantages[7], 0.0f);
  const double a3 = h.in.advantages[3];
  EXPECT_NEAR(capped.loss - plain.loss, (-1.3f * a3 + h.Ratio(3) * a3) / 7, 1e-14);
  EXPECT_EQ(capped.clip_fraction, plain.clip_fraction);
  std::vector<double> dlogp(h.in.bt, 0.0);
  const double lo = 1.0 - static_cast<double>(0.2f), hi = 1.0 + static_cast<double>(0.2f);
  for (int64_t i = 0; i < h.in.bt; ++i) {
    const double a = h.in.advantages[i], ratio = h.Ratio(i);
    const bool c = (ratio < lo && a < 0) || (ratio > hi && a > 0);
    if (h.in.mask[i] == 0 || c || i == 3) continue;
    dlogp[i] = -1.25 * a * ratio / 7;
  }
  ExpectGradientOf(h.p, capped, dlogp);
}

// The bias-corrected KL: k3 r per token, in the loss and in Liger's metric; its gradient
// (k3' + k3) r. Without old log-probs r = 1 and the loss equals the plain one, not the gradient.
TEST(PolicyTypesReferenceTest, BiasCorrectedKl) {
  HandCase h(PolicyLossType::kGrpo);
  h.p.options.beta = 0.4f;
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> shift(-0.8f, 0.8f);
  for (int64_t i = 0; i < h.in.bt; ++i) {
    h.in.ref_logp[i] = static_cast<float>(h.logp[i]) + shift(rng);
  }
  PolicyReferenceOutputs plain, corrected;
  ASSERT_TRUE(PolicyReference(h.p, &plain).ok());
  h.p.options.use_bias_correction_kl = true;
  ASSERT_TRUE(PolicyReference(h.p, &corrected).ok());
  double kl = 0, extra = 0;
  std::vector<double> ddiff(h.in.bt, 0.0);
  for (int64_t i = 0; i < h.in.bt; ++i) {
    if (h.in.mask[i] == 0) continue;
    const double d = h.in.ref_logp[i] - h.logp[i], ratio = h.Ratio(i);
    const double k3 = std::exp(d) - d - 1, n = i < 4 ? 3 : 4;
    kl += k3 * ratio;
    extra += 0.4f * k3 * (ratio - 1) / (2 * n);
    ddiff[i] = 1.25 * 0.4f * ((1 - std::exp(d) + k3) * ratio - (1 - std::exp(d))) / (2 * n);
  }
  EXPECT_NEAR(corrected.kl, kl / 7, 1e-14);
  EXPECT_NEAR(corrected.loss - plain.loss, extra, 1e-14);
  EXPECT_GT(std::fabs(extra), 1e-3);
  // The difference of the two gradients is the logprob gradient of the difference of dlogp.
  const HeadGradients want = LogprobGradient(h.p, ddiff);
  std::vector<double> got(corrected.grad.dx.size());
  for (size_t k = 0; k < got.size(); ++k) got[k] = corrected.grad.dx[k] - plain.grad.dx[k];
  ExpectNearAll(got, want.dx, 1e-6, "d(dx)");

  h.p.old_logp = nullptr;
  h.p.options.use_bias_correction_kl = false;
  ASSERT_TRUE(PolicyReference(h.p, &plain).ok());
  h.p.options.use_bias_correction_kl = true;
  ASSERT_TRUE(PolicyReference(h.p, &corrected).ok());
  EXPECT_EQ(corrected.loss, plain.loss);
  EXPECT_EQ(corrected.kl, plain.kl);
  double differs = 0;
  for (size_t k = 0; k < plain.grad.dx.size(); ++k) {
    differs = std::max(differs, std::fabs(corrected.grad.dx[k] - plain.grad.dx[k]));
  }
  EXPECT_GT(differs, 1e-4);
}

TEST(PolicyTypesReferenceTest, DefaultsAreLigers) {
  const PolicyOptions o;
  EXPECT_EQ(o.sapo_temperature_pos, 1.0f);
  EXPECT_EQ(o.sapo_temperature_neg, 1.05f);
  EXPECT_EQ(o.delta, 0.0f);
  EXPECT_FALSE(o.use_bias_correction_kl);
}

TEST(PolicyTypesReferenceTest, RejectsBadOptions) {
  Inputs in(2, 2, 3, 4, 9);
  PolicyProblem p = in.Problem(false);
  p.options.loss_type = static_cast<PolicyLossType>(12);
  ExpectRefused(p, "options.loss_type 12 is not dapo, grpo, bnpo, dr_grpo, cispo, sapo, luspo");
  p = in.Problem(false);
  p.options.sapo_temperature_pos = 0.0f;
  ExpectRefused(p, "options.sapo_temperature_pos must be finite and > 0, got 0");
  p = in.Problem(false);
  p.options.sapo_temperature_neg = INFINITY;
  ExpectRefused(p, "options.sapo_temperature_neg must be finite and > 0, got inf");
  p = in.Problem(false);
  p.options.delta = 1.1f;
  ExpectRefused(p, "options.delta must be 0 (none) or finite and > 1 + epsilon_high = 1.2");
  p.options.delta = NAN;
  ExpectRefused(p, "options.delta");
  p.options.delta = 2.0f;
  PolicyReferenceOutputs ok;
  EXPECT_TRUE(PolicyReference(p, &ok).ok());
  p.options.loss_type = PolicyLossType::kSapo;
  ExpectRefused(p, "options.delta applies to the clipped loss types; loss_type sapo");
  p.options.loss_type = PolicyLossType::kCispo;
  ExpectRefused(p, "loss_type cispo has no clipped surrogate");
}

}  // namespace
}  // namespace lossd
