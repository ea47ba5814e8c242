// SPDX-License-Identifier: Apache-2.0
// Tests of the distillation reference's hard-label term (LigerFusedLinearJSDLoss's
// weight_hard_loss / weight_soft_loss): the student's gradients against central finite
// differences over jsd_beta x temperature x weights x biases; the term is the cross-entropy of
// the label at temperature 1 whatever T, computed here directly; the weights mix the two parts
// linearly; and the refusals (weights, labels missing or out of range).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "gtest/gtest.h"
#include "core/dtype.h"
#include "kernels/cpu/distill_reference.h"
#include "kernels/cpu/reference_head.h"
#include "testing/finite_difference.h"

namespace lossd {
namespace {

// Random fp32 student (H) and teacher (Ht) heads in [-1, 1) (the teacher's W twice that),
// labels in [0, V) with two rows ignored.
struct Inputs {
  int64_t bt, h, ht, v;
  std::vector<float> x, w, b, xt, wt;
  std::vector<int64_t> labels;

  Inputs(int64_t bt_, int64_t h_, int64_t ht_, int64_t v_, uint32_t seed)
      : bt(bt_), h(h_), ht(ht_), v(v_) {
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    x.resize(bt * h);
    w.resize(v * h);
    b.resize(v);
    xt.resize(bt * ht);
    wt.resize(v * ht);
    for (auto* a : {&x, &w, &b, &xt, &wt}) {
      for (float& e : *a) e = u(rng);
    }
    for (float& e : wt) e *= 2;
    labels.resize(bt);
    std::uniform_int_distribution<int64_t> t(0, v - 1);
    for (int64_t& e : labels) e = t(rng);
    labels[1] = labels[3 % bt] = -100;
  }

  DistillProblem Problem(bool student_bias) {
    DistillProblem p;
    p.student = HeadInputs{bt, h, v, DType::kF32, x.data(), w.data(),
                           student_bias ? b.data() : nullptr};
    p.teacher = HeadInputs{bt, ht, v, DType::kF32, xt.data(), wt.data(), nullptr};
    p.labels = labels.data();
    return p;
  }
};

using FdParam = std::tuple<float /*jsd_beta*/, float /*temperature*/,
                           std::pair<float, float> /*weights*/, bool /*bias*/>;

class DistillHardFiniteDifferenceTest : public ::testing::TestWithParam<FdParam> {};

TEST_P(DistillHardFiniteDifferenceTest, GradientsMatchFiniteDifferences) {
  const auto [beta, temperature, weights, bias] = GetParam();
  Inputs in(5, 3, 4, 7, 31);
  DistillProblem p = in.Problem(bias);
  p.options.jsd_beta = beta;
  p.options.temperature = temperature;
  p.options.grad_scale = 1.25f;
  p.options.weight_hard_loss = weights.first;
  p.options.weight_soft_loss = weights.second;
  DistillReferenceOutputs r;
  ASSERT_TRUE(DistillReference(p, &r).ok());
  ASSERT_EQ(r.tokens, 3);
  EXPECT_GT(r.hard_loss, 1e-2);
  EXPECT_GT(r.soft_loss, 1e-3);
  EXPECT_DOUBLE_EQ(r.loss, weights.first * r.hard_loss + weights.second * r.soft_loss);

  auto objective = [&]() {
    DistillReferenceOutputs f;
    EXPECT_TRUE(DistillReference(p, &f).ok());
    return 1.25 * f.loss;
  };
  double largest = ExpectGradientMatches("dx", in.x.data(), r.grad.dx, objective);
  largest = std::max(largest, ExpectGradientMatches("dw", in.w.data(), r.grad.dw, objective));
  if (bias) ExpectGradientMatches("db", in.b.data(), r.grad.db, objective);
  EXPECT_GT(largest, 100 * kFdAtol);
  for (int64_t k = 0; k < in.h; ++k) EXPECT_EQ(r.grad.dx[1 * in.h + k], 0.0);
}

std::string FdName(const ::testing::TestParamInfo<FdParam>& info) {
  const auto [beta, temperature, weights, bias] = info.param;
  return "beta" + std::to_string(static_cast<int>(beta * 100)) + "_T" +
         std::to_string(static_cast<int>(temperature * 10)) + "_hard" +
         std::to_string(static_cast<int>(weights.first * 100)) + "_soft" +
         std::to_string(static_cast<int>(weights.second * 100)) + (bias ? "_bias" : "");
}

INSTANTIATE_TEST_SUITE_P(
    AllOptions, DistillHardFiniteDifferenceTest,
    ::testing::Combine(::testing::Values(0.0f, 0.5f, 1.0f), ::testing::Values(1.0f, 1.7f),
                       ::testing::Values(std::make_pair(0.5f, 0.5f), std::make_pair(1.0f, 0.0f),
                                         std::make_pair(0.3f, 1.2f)),
                       ::testing::Bool()),
    FdName);

// The hard term is the label's cross-entropy of the raw logits (temperature 1) whatever T,
// computed here directly; the weights mix it with the divergence the defaults give alone.
TEST(DistillReferenceHardTest, HardTermIsTheLabelsCrossEntropyAtTemperatureOne) {
  Inputs in(4, 3, 5, 6, 9);
  double ce = 0;
  int64_t n = 0;
  for (int64_t i = 0; i < in.bt; ++i) {
    if (in.labels[i] == -100) continue;
    std::vector<double> u(in.v);
    double m = -INFINITY;
    for (int64_t j = 0; j < in.v; ++j) {
      u[j] = in.b[j];
      for (int64_t k = 0; k < in.h; ++k) u[j] += double{in.x[i * in.h + k]} * in.w[j * in.h + k];
      m = std::max(m, u[j]);
    }
    double s = 0;
    for (double e : u) s += std::exp(e - m);
    ce += m + std::log(s) - u[in.labels[i]];
    ++n;
  }
  ASSERT_EQ(n, 2);
  DistillProblem p = in.Problem(true);
  p.options.temperature = 2.5f;
  DistillReferenceOutputs soft_only;
  ASSERT_TRUE(DistillReference(p, &soft_only).ok());
  EXPECT_EQ(soft_only.hard_loss, 0.0);
  EXPECT_EQ(soft_only.loss, soft_only.soft_loss);
  p.options.weight_hard_loss = 0.75f;
  p.options.weight_soft_loss = 0.25f;
  DistillReferenceOutputs r;
  ASSERT_TRUE(DistillReference(p, &r).ok());
  EXPECT_NEAR(r.hard_loss, ce / 2, 1e-14);
  EXPECT_NEAR(r.soft_loss, soft_only.loss, 1e-15);
  EXPECT_NEAR(r.loss, 0.75 * ce / 2 + 0.25 * soft_only.loss, 1e-14);
  // Hard alone at T 2.5 and at T 1 give the same loss and gradients (up to rounding).
  p.options.weight_soft_loss = 0.0f;
  ASSERT_TRUE(DistillReference(p, &r).ok());
  p.options.temperature = 1.0f;
  DistillReferenceOutputs at_one;
  ASSERT_TRUE(DistillReference(p, &at_one).ok());
  EXPECT_NEAR(r.loss, at_one.loss, 1e-14);
  for (size_t k = 0; k < r.grad.dw.size(); ++k) {
    ASSERT_NEAR(r.grad.dw[k], at_one.grad.dw[k], 1e-14) << k;
  }
  // All rows ignored: 0, no gradient.
  in.labels.assign(in.bt, -100);
  ASSERT_TRUE(DistillReference(p, &r).ok());
  EXPECT_EQ(r.loss, 0.0);
  for (double g : r.grad.dx) ASSERT_EQ(g, 0.0);
}

TEST(DistillReferenceHardTest, RejectsBadWeightsAndLabels) {
  Inputs in(3, 3, 4, 5, 6);
  auto expect_refused = [&](const DistillProblem& p, const std::string& substring) {
    DistillReferenceOutputs r;
    const absl::Status st = DistillReference(p, &r);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << substring;
    EXPECT_NE(st.message().find(substring), std::string::npos) << st;
  };
  DistillProblem p = in.Problem(false);
  p.options.weight_hard_loss = -0.5f;
  expect_refused(p, "options.weight_hard_loss must be finite and >= 0, got -0.5");
  p.options.weight_hard_loss = 0.5f;
  p.options.weight_soft_loss = NAN;
  expect_refused(p, "options.weight_soft_loss must be finite and >= 0, got nan");
  p.options.weight_soft_loss = 0.5f;
  p.labels = nullptr;
  expect_refused(p, "options.weight_hard_loss 0.5 needs labels");
  p = in.Problem(false);
  p.options.weight_hard_loss = 0.5f;
  in.labels[2] = 5;
  expect_refused(p, "labels[2] = 5 is outside [0, V=5) and is not ignore_index");
  p.options.weight_hard_loss = 0.0f;  // without the hard term labels only mark ignored rows
  DistillReferenceOutputs ok;
  EXPECT_TRUE(DistillReference(p, &ok).ok());
}

}  // namespace
}  // namespace lossd
