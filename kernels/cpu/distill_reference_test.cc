// SPDX-License-Identifier: Apache-2.0
// Tests of the float64 distillation (JSD) reference: the student's gradients against central
// finite differences of its own loss for every combination of jsd_beta, temperature, labels and
// biases; and hand-checkable cases (beta 0 and 1 are the two KLs computed directly, beta 1/2 is
// symmetric, identical heads give 0, the division by the non-ignored count).
#include "kernels/cpu/distill_reference.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "gtest/gtest.h"
#include "core/dtype.h"
#include "kernels/cpu/reference_head.h"
#include "testing/finite_difference.h"

namespace lossd {
namespace {

// Random fp32 student (H) and teacher (Ht) heads over the same rows and vocabulary, owned, in
// [-1, 1) (the teacher's weights twice that, so P and Q differ visibly).
struct Inputs {
  int64_t bt, h, ht, v;
  std::vector<float> x, w, b, xt, wt, bt_bias;
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
    bt_bias.resize(v);
    for (auto* a : {&x, &w, &b, &xt, &wt, &bt_bias}) {
      for (float& e : *a) e = u(rng);
    }
    for (float& e : wt) e *= 2;
    labels.resize(bt);
    std::uniform_int_distribution<int64_t> t(0, v - 1);
    for (int64_t& e : labels) e = t(rng);
  }

  DistillProblem Problem(bool student_bias, bool teacher_bias) {
    DistillProblem p;
    p.student = HeadInputs{bt, h, v, DType::kF32, x.data(), w.data(),
                           student_bias ? b.data() : nullptr};
    p.teacher = HeadInputs{bt, ht, v, DType::kF32, xt.data(), wt.data(),
                           teacher_bias ? bt_bias.data() : nullptr};
    p.labels = labels.data();
    return p;
  }
};

// log softmax(z / T) of row i of a head, computed here independently of the reference.
std::vector<double> LogSoftmax(const float* x, const float* w, const float* b, int64_t h,
                               int64_t v, int64_t i, double t) {
  std::vector<double> z(v);
  double m = -INFINITY;
  for (int64_t j = 0; j < v; ++j) {
    double u = b != nullptr ? b[j] : 0.0;
    for (int64_t k = 0; k < h; ++k) u += static_cast<double>(x[i * h + k]) * w[j * h + k];
    z[j] = u / t;
    m = std::max(m, z[j]);
  }
  double s = 0;
  for (double e : z) s += std::exp(e - m);
  for (double& e : z) e -= m + std::log(s);
  return z;
}

enum Biases { kNoBias, kStudentBias, kBothBiases };

using FdParam = std::tuple<float /*jsd_beta*/, float /*temperature*/, bool /*labels*/, Biases>;

class DistillFiniteDifferenceTest : public ::testing::TestWithParam<FdParam> {};

TEST_P(DistillFiniteDifferenceTest, GradientsMatchFiniteDifferences) {
  const auto [beta, temperature, labels, biases] = GetParam();
  Inputs in(5, 3, 4, 7, 13);
  in.labels[1] = in.labels[3] = -100;
  DistillProblem p = in.Problem(biases != kNoBias, biases == kBothBiases);
  if (!labels) p.labels = nullptr;
  p.options.jsd_beta = beta;
  p.options.temperature = temperature;
  p.options.grad_scale = 1.25f;
  DistillReferenceOutputs r;
  ASSERT_TRUE(DistillReference(p, &r).ok());
  ASSERT_EQ(r.tokens, labels ? 3 : 5);
  ASSERT_EQ(r.grad.db.size(), biases != kNoBias ? 7u : 0u);
  EXPECT_GT(r.loss, 1e-3);

  auto objective = [&]() {
    DistillReferenceOutputs f;
    EXPECT_TRUE(DistillReference(p, &f).ok());
    return 1.25 * f.loss;
  };
  double largest = ExpectGradientMatches("dx", in.x.data(), r.grad.dx, objective);
  largest = std::max(largest, ExpectGradientMatches("dw", in.w.data(), r.grad.dw, objective));
  if (biases != kNoBias) ExpectGradientMatches("db", in.b.data(), r.grad.db, objective);
  EXPECT_GT(largest, 100 * kFdAtol);  // the comparisons above were not of zeros
  if (labels) {
    for (int64_t k = 0; k < in.h; ++k) EXPECT_EQ(r.grad.dx[1 * in.h + k], 0.0);
    EXPECT_EQ(r.row_loss[3], 0.0);
  }
}

std::string FdName(const ::testing::TestParamInfo<FdParam>& info) {
  const auto [beta, temperature, labels, biases] = info.param;
  std::string name = "beta" + std::to_string(static_cast<int>(beta * 100)) + "_T" +
                     std::to_string(static_cast<int>(temperature * 10));
  name += labels ? "_labels" : "_nolabels";
  return name + (biases == kNoBias ? "" : biases == kStudentBias ? "_sbias" : "_stbias");
}

INSTANTIATE_TEST_SUITE_P(
    AllOptions, DistillFiniteDifferenceTest,
    ::testing::Combine(::testing::Values(0.0f, 0.25f, 0.5f, 1.0f), ::testing::Values(1.0f, 1.7f),
                       ::testing::Bool(),
                       ::testing::Values(kNoBias, kStudentBias, kBothBiases)),
    FdName);

// beta 0 is KL(P || Q) and beta 1 is KL(Q || P), each computed here directly; beta 1/2 is the
// symmetric JSD (swapping the heads changes nothing) and below ln 2 per row.
TEST(DistillReferenceTest, EndsAreTheTwoKlsAndTheMiddleIsSymmetric) {
  Inputs in(4, 3, 3, 6, 21);  // H = Ht, so the heads can swap
  in.labels[2] = -100;
  const double t = 1.5;
  double forward = 0, reverse = 0;
  for (int64_t i = 0; i < in.bt; ++i) {
    if (i == 2) continue;
    const std::vector<double> lq = LogSoftmax(in.x.data(), in.w.data(), nullptr, 3, 6, i, t);
    const std::vector<double> lp =
        LogSoftmax(in.xt.data(), in.wt.data(), in.bt_bias.data(), 3, 6, i, t);
    for (int64_t j = 0; j < 6; ++j) {
      forward += std::exp(lp[j]) * (lp[j] - lq[j]);
      reverse += std::exp(lq[j]) * (lq[j] - lp[j]);
    }
  }
  DistillProblem p = in.Problem(false, true);
  p.options.temperature = static_cast<float>(t);
  DistillReferenceOutputs r;
  p.options.jsd_beta = 0.0f;
  ASSERT_TRUE(DistillReference(p, &r).ok());
  EXPECT_NEAR(r.loss, forward / 3, 1e-14);
  p.options.jsd_beta = 1.0f;
  ASSERT_TRUE(DistillReference(p, &r).ok());
  EXPECT_NEAR(r.loss, reverse / 3, 1e-14);
  EXPECT_GT(std::fabs(forward - reverse), 1e-3);  // the two are told apart

  p.options.jsd_beta = 0.5f;
  DistillReferenceOutputs mid, swapped;
  ASSERT_TRUE(DistillReference(p, &mid).ok());
  std::swap(p.student, p.teacher);
  ASSERT_TRUE(DistillReference(p, &swapped).ok());
  EXPECT_NEAR(mid.loss, swapped.loss, 1e-15);
  EXPECT_GT(mid.loss, 0.0);
  EXPECT_LT(mid.loss, std::log(2.0));
  // Liger's general form tends to 0, not to the KL, as beta -> 0: the end is a special case.
  p.options.jsd_beta = 1e-6f;
  ASSERT_TRUE(DistillReference(p, &r).ok());
  EXPECT_LT(r.loss, 1e-4);
}

// A student equal to its teacher has no divergence and no gradient, at every beta.
TEST(DistillReferenceTest, IdenticalHeadsGiveZero) {
  Inputs in(3, 4, 4, 5, 8);
  for (float beta : {0.0f, 0.3f, 1.0f}) {
    DistillProblem p = in.Problem(true, true);
    p.teacher = p.student;
    p.options.jsd_beta = beta;
    DistillReferenceOutputs r;
    ASSERT_TRUE(DistillReference(p, &r).ok());
    EXPECT_NEAR(r.loss, 0.0, 1e-15) << beta;
    for (double g : r.grad.dx) EXPECT_NEAR(g, 0.0, 1e-15) << beta;
    for (double g : r.grad.dw) EXPECT_NEAR(g, 0.0, 1e-15) << beta;
  }
}

// The loss is the row sum over the non-ignored count; every label value but ignore_index counts
// (labels are never range-checked, as in Liger); all ignored gives 0.
TEST(DistillReferenceTest, DividesByTheNonIgnoredCount) {
  Inputs in(4, 3, 5, 6, 4);
  in.labels = {7, -1, 123456, -1};  // -1 is the ignore_index below
  DistillProblem p = in.Problem(false, false);
  p.options.ignore_index = -1;
  DistillReferenceOutputs r;
  ASSERT_TRUE(DistillReference(p, &r).ok());
  EXPECT_EQ(r.tokens, 2);
  EXPECT_GT(r.row_loss[0], 0.0);
  EXPECT_EQ(r.row_loss[1], 0.0);
  EXPECT_NEAR(r.loss, (r.row_loss[0] + r.row_loss[2]) / 2, 1e-16);
  in.labels = {-1, -1, -1, -1};
  ASSERT_TRUE(DistillReference(p, &r).ok());
  EXPECT_EQ(r.tokens, 0);
  EXPECT_EQ(r.loss, 0.0);
  for (double g : r.grad.dx) ASSERT_EQ(g, 0.0);
  for (double g : r.grad.dw) ASSERT_EQ(g, 0.0);
}

TEST(DistillReferenceTest, DefaultsAreLigers) {
  const DistillOptions o;
  EXPECT_EQ(o.jsd_beta, 0.5f);
  EXPECT_EQ(o.temperature, 1.0f);
  EXPECT_EQ(o.ignore_index, -100);
}

TEST(DistillReferenceTest, RejectsBadInput) {
  Inputs in(2, 3, 4, 5, 6);
  auto expect_refused = [&](const DistillProblem& p, const std::string& substring) {
    DistillReferenceOutputs r;
    const absl::Status st = DistillReference(p, &r);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << substring;
    EXPECT_NE(st.message().find(substring), std::string::npos) << st;
  };
  DistillProblem p = in.Problem(true, true);
  DistillReferenceOutputs ok;
  ASSERT_TRUE(DistillReference(p, &ok).ok());
  p.options.jsd_beta = 1.5f;
  expect_refused(p, "options.jsd_beta must be in [0, 1], got 1.5");
  p.options.jsd_beta = NAN;
  expect_refused(p, "options.jsd_beta");
  p = in.Problem(true, true);
  p.options.temperature = 0.0f;
  expect_refused(p, "options.temperature must be finite and > 0, got 0");
  p = in.Problem(true, true);
  p.teacher.v = 4;
  expect_refused(p, "teacher: rows and vocabulary (2, 4) must equal the student's (2, 5)");
  p = in.Problem(true, true);
  p.teacher.x = nullptr;
  expect_refused(p, "teacher: x and w must be non-null");
  p = in.Problem(true, true);
  p.label_dtype = DType::kF32;
  expect_refused(p, "labels: dtype must be int32 or int64, got");
  p = in.Problem(true, true);
  p.options.grad_scale = INFINITY;
  expect_refused(p, "options.grad_scale must be finite");
}

}  // namespace
}  // namespace lossd
