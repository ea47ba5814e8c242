// SPDX-License-Identifier: Apache-2.0
// Tests of the float64 policy-loss reference's sequence-level importance sampling (GSPO,
// Liger's importance_sampling_level "sequence"): the gradient against central finite
// differences over every clipped loss type, delta, old log-probs, KL term, bias-corrected KL,
// mask and head options; and hand-checkable cases (equal log-ratios within each sequence give
// the token level's loss and gradients; the clip metric counts whole sequences; one shared
// coefficient per sequence; the refusals).
#include <algorithm>
#include <cmath>
#include <cstdint>
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

struct SeqCase {
  const char* name;
  PolicyLossType type;
  float delta;
};

constexpr SeqCase kSeqCases[] = {
    {"dapo", PolicyLossType::kDapo, 0.0f},     {"grpo", PolicyLossType::kGrpo, 0.0f},
    {"bnpo", PolicyLossType::kBnpo, 0.0f},     {"dr_grpo", PolicyLossType::kDrGrpo, 0.0f},
    {"luspo", PolicyLossType::kLuspo, 0.0f},   {"dapo_delta", PolicyLossType::kDapo, 1.35f},
};

// Per-token log-ratios (B = 2 sequences of S = 4): sequence 0 about log 0.7 (below the lower
// bound 0.8: its A < 0 tokens clipped), sequence 1 about log 1.5 (above 1.28: its A > 0 tokens
// clipped, its A < 0 ones capped by delta 1.35). The spread within each sequence (up to 0.1)
// moves a masked sequence's mean by at most 0.05: no bound is approached.
const double kSeqLogRatios[8] = {std::log(0.7) + 0.1,  std::log(0.7) - 0.1,
                                 std::log(0.7) + 0.05, std::log(0.7) - 0.05,
                                 std::log(1.5) - 0.08, std::log(1.5) + 0.02,
                                 std::log(1.5) + 0.1,  std::log(1.5) - 0.04};

using FdParam = std::tuple<SeqCase, bool /*old*/, KlCase, bool /*bias correction*/,
                           bool /*mask*/, bool /*bias and softcap*/>;

class PolicySequenceFiniteDifferenceTest : public ::testing::TestWithParam<FdParam> {};

TEST_P(PolicySequenceFiniteDifferenceTest, GradientMatchesFiniteDifferences) {
  const auto [seq_case, old, kl, bias_correction, masked, head_options] = GetParam();
  Inputs in(2, 4, 3, 6, 23);
  PolicyProblem p = in.Problem(head_options);
  PolicyOptions& o = p.options;
  o.importance_sampling = ImportanceSampling::kSequence;
  o.loss_type = seq_case.type;
  o.epsilon_low = 0.2f;
  o.epsilon_high = 0.28f;
  o.delta = seq_case.delta;
  o.max_completion_length = 5;
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
  SetOldAndRefLogprobs(logp, 11, old, kl, &in, &p);
  for (int64_t i = 0; i < in.bt; ++i) {
    in.old_logp[i] = static_cast<float>(logp[i] - kSeqLogRatios[i]);
  }

  PolicyReferenceOutputs r;
  ASSERT_TRUE(PolicyReference(p, &r).ok());
  EXPECT_EQ(r.tokens, masked ? 6 : 8);
  ExpectKlMetric(r, kl);
  // One ratio per sequence.
  for (int64_t i = 0; i < in.bt; ++i) {
    if (in.mask[i]) EXPECT_EQ(r.ratio[i], r.ratio[i < 4 ? (masked ? 1 : 0) : 4]) << i;
  }
  const FrozenProblem fp(p, logp);
  auto objective = [&]() { return ScaledLoss(fp.q); };
  ExpectHeadGradientMatches(in, r.grad, head_options, objective);
  EXPECT_NEAR(objective(), o.grad_scale * r.loss, 1e-6);
}

std::string FdName(const ::testing::TestParamInfo<FdParam>& info) {
  const auto [seq_case, old, kl, bias_correction, masked, head_options] = info.param;
  return std::string(seq_case.name) + OldKlName(old, kl) + (bias_correction ? "_biascorr" : "") +
         MaskHeadName(masked, head_options);
}

INSTANTIATE_TEST_SUITE_P(
    AllOptions, PolicySequenceFiniteDifferenceTest,
    ::testing::Combine(::testing::ValuesIn(kSeqCases), ::testing::Bool(),
                       ::testing::Values(kNoKl, kKlWithRef, kBetaWithoutRef), ::testing::Bool(),
                       ::testing::Bool(), ::testing::Bool()),
    FdName);

// A problem whose old log-probs put every token of sequence b at log-ratio `log_ratio[b]`, its
// advantages one value per sequence (Liger's (B) advantages repeated), row 2 masked.
struct EqualRatios {
  Inputs in{2, 4, 3, 6, 31};
  std::vector<double> logp;
  PolicyProblem p;
  EqualRatios(double r0, double r1) {
    in.MaskUnread(2);
    for (int64_t i = 0; i < in.bt; ++i) in.advantages[i] = i < 4 ? -0.8f : 1.1f;
    p = in.Problem(true);
    p.options.beta = 0.1f;
    p.options.epsilon_high = 0.28f;
    logp = in.CurrentLogprobs(p);
    for (int64_t i = 0; i < in.bt; ++i) {
      in.old_logp[i] = static_cast<float>(logp[i] - std::log(i < 4 ? r0 : r1));
      in.ref_logp[i] = static_cast<float>(logp[i] + 0.2 * ((i % 3) - 1));
    }
  }
};

// With one log-ratio per sequence and one advantage per sequence, the sequence's ratio is its
// tokens' own and every row weight is the same within a sequence, so the sequence level gives
// the token level's loss, metrics and gradients (the gradient through the mean, summed over
// the sequence, equals each token's own), for the clipped types. Not with the bias-corrected
// KL: there each token's k3_i R reaches every token of its sequence through R, not its own.
TEST(PolicySequenceReferenceTest, EqualRatiosGiveTheTokenLevel) {
  for (PolicyLossType type : {PolicyLossType::kDapo, PolicyLossType::kGrpo,
                              PolicyLossType::kLuspo}) {
    {
      EqualRatios c(0.9, 1.1);
      c.p.options.loss_type = type;
      PolicyReferenceOutputs token, sequence;
      ASSERT_TRUE(PolicyReference(c.p, &token).ok());
      c.p.options.importance_sampling = ImportanceSampling::kSequence;
      ASSERT_TRUE(PolicyReference(c.p, &sequence).ok());
      // The old log-probs are fp32, so a sequence's log-ratios differ by ~1e-7 from one
      // another: the ratios (and so the gradients) agree to that, not to double's epsilon.
      EXPECT_NEAR(sequence.loss, token.loss, 1e-6 * std::fabs(token.loss));
      EXPECT_EQ(sequence.kl, token.kl);  // k3_i alone: the same numbers in the same order
      EXPECT_EQ(sequence.clip_fraction, token.clip_fraction);
      ExpectNearAll(sequence.grad.dx, token.grad.dx, 1e-6, "dx");
      ExpectNearAll(sequence.grad.dw, token.grad.dw, 1e-6, "dw");
      ExpectNearAll(sequence.grad.db, token.grad.db, 1e-6, "db");
    }
  }
}

// Different log-ratios within a sequence: the sequence's one ratio is the exp of their masked
// mean, every token of it shares one coefficient dloss/dlogp (beta 0, one advantage per
// sequence), and the clip metric counts a clipped sequence's every counted token.
TEST(PolicySequenceReferenceTest, OneRatioAndOneCoefficientPerSequence) {
  EqualRatios c(1.0, 1.0);
  c.p.options.beta = 0.0f;
  c.p.options.importance_sampling = ImportanceSampling::kSequence;
  const double lr[8] = {-0.1, -0.5, 0.0, -0.3, 0.1, 0.0, 0.2, 0.1};  // row 2 masked
  for (int64_t i = 0; i < c.in.bt; ++i) {
    if (i != 2) c.in.old_logp[i] = static_cast<float>(c.logp[i] - lr[i]);
  }
  PolicyReferenceOutputs r;
  ASSERT_TRUE(PolicyReference(c.p, &r).ok());
  const double old_f[8] = {c.in.old_logp[0], c.in.old_logp[1], 0, c.in.old_logp[3],
                           c.in.old_logp[4], c.in.old_logp[5], c.in.old_logp[6],
                           c.in.old_logp[7]};
  const double r0 = std::exp(((c.logp[0] - old_f[0]) + (c.logp[1] - old_f[1]) +
                              (c.logp[3] - old_f[3])) / 3.0);                    // ~0.72
  double s1 = 0;
  for (int64_t i = 4; i < 8; ++i) s1 += c.logp[i] - old_f[i];
  const double r1 = std::exp(s1 / 4.0);                                         // ~1.105
  EXPECT_NEAR(r.ratio[0], r0, 1e-12);
  EXPECT_NEAR(r.ratio[7], r1, 1e-12);
  // Sequence 0 (A = -0.8 < 0, R below 0.8) is clipped: its 3 counted tokens of N = 7;
  // sequence 1 (R within the bounds) is not.
  const double n = 7;
  EXPECT_DOUBLE_EQ(r.clip_fraction, 3 / n);
  // dapo: loss = sum_i -min(R A, C A) / N; the clipped sequence has no gradient, the other's
  // tokens each dloss/dlogp = (1 / n_b) sum_{i in b} (1 / N) (-A R) = -A R / N.
  const double a0 = c.in.advantages[0], a1 = c.in.advantages[4];
  const double lo = 1.0 - static_cast<double>(0.2f), hi = 1.0 + static_cast<double>(0.28f);
  const double c0 = std::clamp(r0, lo, hi);
  EXPECT_NEAR(r.loss, (-3 * std::min(r0 * a0, c0 * a0) - 4 * r1 * a1) / n, 1e-12);
  for (int64_t i = 0; i < 8; ++i) {
    if (i == 2) continue;
    EXPECT_NEAR(r.dl_dlogp[i], i < 4 ? 0.0 : -a1 * r1, 1e-12) << i;  // dloss/dlogp over w
  }
}

// A sequence's coefficient when nothing is clipped: dloss/dlogp_j = m_j / n_b sum_i w_i
// (-A_i R_b), the same for each token of b whatever its own advantage (per-token advantages).
TEST(PolicySequenceReferenceTest, TokenAdvantagesShareTheSequenceCoefficient) {
  EqualRatios c(0.95, 1.05);
  c.p.options.beta = 0.0f;
  c.p.options.loss_type = PolicyLossType::kBnpo;
  c.p.options.importance_sampling = ImportanceSampling::kSequence;
  c.in.advantages = {0.5f, -0.25f, 9.0f, 0.75f, -0.5f, 0.25f, 1.0f, -1.5f};  // row 2 masked
  c.p.advantages = c.in.advantages.data();
  PolicyReferenceOutputs r;
  ASSERT_TRUE(PolicyReference(c.p, &r).ok());
  const double n = 7;
  const double r0 = r.ratio[0], r1 = r.ratio[4];
  const double want0 = -(0.5 - 0.25 + 0.75) * r0 / 3.0;  // dl_dlogp = dloss/dlogp / w, w = 1/N
  const double want1 = -(-0.5 + 0.25 + 1.0 - 1.5) * r1 / 4.0;
  for (int64_t i : {0, 1, 3}) EXPECT_NEAR(r.dl_dlogp[i], want0, 1e-12) << i;
  for (int64_t i : {4, 5, 6, 7}) EXPECT_NEAR(r.dl_dlogp[i], want1, 1e-12) << i;
  EXPECT_NEAR(r.loss, -((0.5 - 0.25 + 0.75) * r0 + (-0.5 + 0.25 + 1.0 - 1.5) * r1) / n, 1e-12);
}

TEST(PolicySequenceReferenceTest, DefaultIsTokenLevel) {
  EXPECT_EQ(PolicyOptions().importance_sampling, ImportanceSampling::kToken);
  EXPECT_STREQ(ImportanceSamplingName(ImportanceSampling::kSequence), "sequence");
}

TEST(PolicySequenceReferenceTest, RejectsBadOptions) {
  Inputs in(2, 2, 3, 4, 9);
  PolicyProblem p = in.Problem(false);
  p.options.importance_sampling = static_cast<ImportanceSampling>(2);
  ExpectRefused(p, "options.importance_sampling 2 is not token (0) or sequence (1)");
  p.options.importance_sampling = ImportanceSampling::kSequence;
  p.options.loss_type = PolicyLossType::kCispo;
  ExpectRefused(p, "options.importance_sampling sequence applies to the clipped loss types; "
                   "loss_type cispo takes token-level ratios only");
  p.options.loss_type = PolicyLossType::kSapo;
  ExpectRefused(p, "loss_type sapo takes token-level ratios only");
}

}  // namespace
}  // namespace lossd
