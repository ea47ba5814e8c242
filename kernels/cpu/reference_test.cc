// SPDX-License-Identifier: Apache-2.0
// Tests of the float64 reference: a hand-computed case, and every gradient against central
// finite differences of its own loss (so the gradient formula is checked independently).
#include "kernels/cpu/reference.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "testing/test_util.h"
#include "core/dtype.h"
#include "core/loss_problem.h"
#include "core/loss_problem_check.h"

namespace lossd {
namespace {

// An fp32 problem over the caller's arrays: X (bt, h), W (v, h), targets (bt) of
// target_dtype; no bias, class weights or grad_output, every option at its default.
LossProblem F32Problem(int64_t bt, int64_t h, int64_t v, const float* x, const float* w,
                       const void* targets, DType target_dtype = DType::kI64) {
  LossProblem p;
  p.bt = bt;
  p.h = h;
  p.v = v;
  p.dtype = DType::kF32;
  p.x = x;
  p.w = w;
  p.targets = targets;
  p.target_dtype = target_dtype;
  return p;
}

TEST(ReferenceTest, HandComputedTinyProblem) {
  // BT=2, H=3, V=5. x_0 = e_0 and x_1 = e_1 pick columns 0 and 1 of W as the logits:
  // z_0 = (0,0,0,0,0), target 2: nll = ln 5.
  // z_1 = (1,0,0,0,0), target 0: nll = ln(e + 4) - 1.
  const float x[6] = {1, 0, 0, 0, 1, 0};
  const float w[15] = {0, 1, 7, 0, 0, -3, 0, 0, 2, 0, 0, 5, 0, 0, 1};
  const int64_t targets[2] = {2, 0};
  const LossProblem p = F32Problem(2, 3, 5, x, w, targets);
  ReferenceOutputs r;
  ASSERT_TRUE(ReferenceCompute(p, &r).ok());
  const double nll0 = 1.6094379124341003, nll1 = 0.904832441554448;
  EXPECT_NEAR(r.loss[0], (nll0 + nll1) / 2, 1e-15);
  EXPECT_NEAR(r.loss[0], 1.2571351769942742, 1e-15);
  EXPECT_EQ(r.z_loss[0], 0.0);
  EXPECT_NEAR(r.lse[0], std::log(5.0), 1e-15);
  EXPECT_NEAR(r.lse[1], std::log(std::exp(1.0) + 4), 1e-15);
  EXPECT_EQ(r.predictions[0], 0);  // all tied: first index
  EXPECT_EQ(r.predictions[1], 0);
  EXPECT_EQ(r.tokens, 2);
  EXPECT_EQ(r.accuracy, 0.5);
  // dL/dz_0j = (0.2 - [j==2]) / 2; dX_0 = g_0 W, so dX_00 = sum_j g_0j W_j0 = 0 (column 0 is 0
  // except W_00 = 0) and dX_02 = sum_j g_0j W_j2 = 0.1*(7 - 3 + 0 + 0 + 1) - 0.5*(-3) ... by
  // the formula below.
  double dx02 = 0;
  for (int j = 0; j < 5; ++j) dx02 += (0.2 - (j == 2 ? 1 : 0)) / 2 * w[j * 3 + 2];
  EXPECT_NEAR(r.dx[2], dx02, 1e-15);
  EXPECT_NEAR(r.dx[2], 0.5 * (0.2 * (7 - 3 + 2 + 5 + 1) - 2), 1e-15);
  EXPECT_TRUE(r.db.empty());
}

struct FdCase {
  std::string name;
  Reduction reduction;
  float eps, zs, cap;
  bool weights, bias, ignore, grad_output;
};

void PrintTo(const FdCase& c, std::ostream* os) { *os << c.name; }

class ReferenceFiniteDifferenceTest : public ::testing::TestWithParam<FdCase> {};

// The scalar whose gradient the reference returns.
double Objective(const LossProblem& p) {
  ReferenceOutputs r;
  EXPECT_TRUE(ReferenceCompute(p, &r).ok());
  if (p.options.reduction != Reduction::kNone) return p.options.grad_scale * r.loss[0];
  double f = 0;
  for (int64_t i = 0; i < p.bt; ++i) f += (p.grad_output ? p.grad_output[i] : 1.0) * r.loss[i];
  return f;
}

// Central difference of Objective in *value, with the steps actually stored in fp32.
double FiniteDifference(LossProblem& p, float* value) {
  const float orig = *value;
  const float up = orig + 1e-3f, down = orig - 1e-3f;
  *value = up;
  const double f_up = Objective(p);
  *value = down;
  const double f_down = Objective(p);
  *value = orig;
  return (f_up - f_down) / (static_cast<double>(up) - static_cast<double>(down));
}

TEST_P(ReferenceFiniteDifferenceTest, GradientsMatchFiniteDifferences) {
  const FdCase& c = GetParam();
  const int64_t bt = 5, h = 3, v = 7;
  std::mt19937 rng(42);
  std::uniform_real_distribution<float> u(-1.5f, 1.5f);
  std::vector<float> x(bt * h), w(v * h), b(v), cw(v), go(bt);
  for (float& e : x) e = u(rng);
  for (float& e : w) e = u(rng);
  for (float& e : b) e = u(rng);
  for (float& e : cw) e = 0.25f + std::fabs(u(rng));
  for (float& e : go) e = u(rng);
  std::vector<int64_t> targets = {3, 6, 0, 2, 5};
  if (c.ignore) targets[1] = -100;
  LossProblem p = F32Problem(bt, h, v, x.data(), w.data(), targets.data());
  p.bias = c.bias ? b.data() : nullptr;
  p.class_weights = c.weights ? cw.data() : nullptr;
  p.grad_output = c.grad_output ? go.data() : nullptr;
  p.options.reduction = c.reduction;
  p.options.label_smoothing = c.eps;
  p.options.z_loss_scale = c.zs;
  p.options.softcap = c.cap;
  p.options.grad_scale = 0.75f;
  ReferenceOutputs r;
  ASSERT_TRUE(ReferenceCompute(p, &r).ok());
  ASSERT_EQ(r.db.size(), c.bias ? static_cast<size_t>(v) : 0u);

  // Truncation error of a 1e-3 central difference is ~1e-6 * f''' here; the analytic values
  // are O(0.1).
  auto check = [&](const char* what, int64_t idx, float* value, double analytic) {
    const double fd = FiniteDifference(p, value);
    EXPECT_NEAR(analytic, fd, 1e-5 + 1e-4 * std::fabs(fd)) << what << "[" << idx << "]";
  };
  for (int64_t k = 0; k < bt * h; ++k) check("dx", k, &x[k], r.dx[k]);
  for (int64_t k = 0; k < v * h; ++k) check("dw", k, &w[k], r.dw[k]);
  if (c.bias) {
    for (int64_t k = 0; k < v; ++k) check("db", k, &b[k], r.db[k]);
  }
  if (c.ignore) {
    for (int64_t k = 0; k < h; ++k) EXPECT_EQ(r.dx[1 * h + k], 0.0);
    EXPECT_EQ(r.tokens, bt - 1);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Options, ReferenceFiniteDifferenceTest,
    ::testing::Values(
        FdCase{"mean", Reduction::kMean, 0, 0, 0, false, false, false, false},
        FdCase{"sum", Reduction::kSum, 0, 0, 0, false, false, false, false},
        FdCase{"none", Reduction::kNone, 0, 0, 0, false, false, false, true},
        FdCase{"none_no_grad_output", Reduction::kNone, 0, 0, 0, false, false, false, false},
        FdCase{"ignore", Reduction::kMean, 0, 0, 0, false, false, true, false},
        FdCase{"smoothing", Reduction::kMean, 0.1f, 0, 0, false, false, false, false},
        FdCase{"zloss", Reduction::kMean, 0, 1e-2f, 0, false, false, true, false},
        FdCase{"softcap", Reduction::kSum, 0, 0, 2.0f, false, false, false, false},
        FdCase{"weights", Reduction::kMean, 0, 0, 0, true, false, true, false},
        FdCase{"weights_smoothing", Reduction::kMean, 0.2f, 0, 0, true, false, false, false},
        FdCase{"bias", Reduction::kMean, 0, 0, 0, false, true, false, false},
        FdCase{"combined_mean", Reduction::kMean, 0.1f, 1e-2f, 3.0f, true, true, true, false},
        FdCase{"combined_none", Reduction::kNone, 0.1f, 1e-2f, 3.0f, true, true, true, true}),
    [](const ::testing::TestParamInfo<FdCase>& info) { return info.param.name; });

// The reference reads bf16/fp16 exactly: the same values given as fp32 give bit-identical
// float64 outputs.
TEST(ReferenceTest, HalfInputsAreWidenedExactly) {
  for (DType dtype : {DType::kBF16, DType::kF16}) {
    RandomProblemSpec spec = ShapeSpec(9, 12, 33, dtype);
    spec.bias = true;
    spec.options.label_smoothing = 0.1f;
    const RandomProblem rp = RandomProblem::Make(spec);
    const LossProblem half = rp.problem();
    std::vector<float> x(spec.bt * spec.h), w(spec.v * spec.h), b(spec.v);
    for (size_t k = 0; k < x.size(); ++k) x[k] = LoadAsFloat(half.x, dtype, k);
    for (size_t k = 0; k < w.size(); ++k) w[k] = LoadAsFloat(half.w, dtype, k);
    for (size_t k = 0; k < b.size(); ++k) b[k] = LoadAsFloat(half.bias, dtype, k);
    LossProblem full = half;
    full.dtype = DType::kF32;
    full.x = x.data();
    full.w = w.data();
    full.bias = b.data();
    ReferenceOutputs a, c;
    ASSERT_TRUE(ReferenceCompute(half, &a).ok());
    ASSERT_TRUE(ReferenceCompute(full, &c).ok());
    EXPECT_EQ(a.loss, c.loss) << DTypeName(dtype);
    EXPECT_EQ(a.lse, c.lse);
    EXPECT_EQ(a.dx, c.dx);
    EXPECT_EQ(a.dw, c.dw);
    EXPECT_EQ(a.db, c.db);
  }
}

TEST(ReferenceTest, AllIgnoredGivesZeroLossAndGradients) {
  const float x[6] = {1, 2, 3, 4, 5, 6};
  const float w[6] = {1, -1, 2, -2, 3, -3};
  const int32_t targets[2] = {-1, -1};
  LossProblem p = F32Problem(2, 3, 2, x, w, targets, DType::kI32);
  p.options.ignore_index = -1;
  p.options.z_loss_scale = 1e-3f;
  ReferenceOutputs r;
  ASSERT_TRUE(ReferenceCompute(p, &r).ok());
  EXPECT_EQ(r.loss[0], 0.0);
  EXPECT_EQ(r.z_loss[0], 0.0);
  EXPECT_EQ(r.tokens, 0);
  EXPECT_EQ(r.accuracy, 0.0);
  for (double d : r.dx) EXPECT_EQ(d, 0.0);
  for (double d : r.dw) EXPECT_EQ(d, 0.0);
  for (double d : r.lse) EXPECT_TRUE(std::isfinite(d));
}

// torch's mean with class weights whose sum over the targets is 0 divides by zero (NaN or
// inf); lossd's cross-entropy part is then 0, and so is its gradient.
TEST(ReferenceTest, ClassWeightsSummingToZeroGiveAZeroMean) {
  RandomProblemSpec s;
  s.bt = 2;
  s.v = 7;
  s.dtype = DType::kF32;
  s.class_weights = true;
  RandomProblem rp = RandomProblem::Make(s);
  rp.targets = {1, 4};
  rp.class_weights[1] = 0.75f;
  rp.class_weights[4] = -0.75f;
  ReferenceOutputs r;
  ASSERT_TRUE(ReferenceCompute(rp.problem(), &r).ok());
  EXPECT_EQ(r.loss[0], 0.0);
  for (double g : r.dx) ASSERT_EQ(g, 0.0);
  for (double g : r.dw) ASSERT_EQ(g, 0.0);
  // The same weights with a non-zero sum give a non-zero mean: the check above can fail.
  rp.class_weights[4] = -0.5f;
  ASSERT_TRUE(ReferenceCompute(rp.problem(), &r).ok());
  EXPECT_NE(r.loss[0], 0.0);
}

// Token scaling checked from outside: with no label smoothing a row's unscaled cross-entropy
// is cw_t (lse - z_t), so s = p_t = exp(-ce / cw_t). The scaled loss and z-loss must be s times
// the unscaled ones, the scaled mean must weigh each row by its s, and the scaled gradients
// must be those of the unscaled problem with s as each row's upstream gradient.
TEST(ReferenceTest, TokenScalingScalesEachRowByItsTargetsProbability) {
  RandomProblemSpec spec = ShapeSpec(9, 6, 13, DType::kF32);
  spec.bias = spec.class_weights = true;
  spec.ignore_fraction = 0.25;
  spec.options.reduction = Reduction::kNone;
  spec.options.z_loss_scale = 0.05f;
  spec.options.softcap = 4.0f;
  RandomProblem rp = RandomProblem::Make(spec);
  LossProblem p = rp.problem();
  ReferenceOutputs plain, scaled, upstream;
  ASSERT_TRUE(ReferenceCompute(p, &plain).ok());
  p.options.token_scaling = true;
  ASSERT_TRUE(ReferenceCompute(p, &scaled).ok());
  std::vector<float> s(spec.bt, 0.0f);
  double ce_sum = 0, z_sum = 0, w_sum = 0;
  int64_t n = 0, ignored = 0;
  for (int64_t i = 0; i < spec.bt; ++i) {
    const int64_t t = rp.targets[i];
    if (t == spec.options.ignore_index) {
      EXPECT_EQ(scaled.loss[i], 0.0);
      ++ignored;
      continue;
    }
    const double ce = plain.loss[i] - plain.z_loss[i];
    const double si = std::exp(-ce / rp.class_weights[t]);
    ASSERT_GT(si, 0.0);
    ASSERT_LT(si, 1.0);
    s[i] = static_cast<float>(si);
    EXPECT_NEAR(scaled.loss[i], si * plain.loss[i], 1e-12 * (1 + plain.loss[i])) << i;
    EXPECT_NEAR(scaled.z_loss[i], si * plain.z_loss[i], 1e-12 * (1 + plain.z_loss[i])) << i;
    ce_sum += si * ce;
    z_sum += si * plain.z_loss[i];
    w_sum += rp.class_weights[t];
    ++n;
  }
  ASSERT_GT(ignored, 0);
  // The gradients: the unscaled problem with s (as fp32, so the comparison is exact up to
  // that rounding) as the per-row upstream gradient.
  std::vector<float> s_rounded = s;
  LossProblem q = rp.problem();
  q.grad_output = s_rounded.data();
  ASSERT_TRUE(ReferenceCompute(q, &upstream).ok());
  auto near_all = [](const std::vector<double>& a, const std::vector<double>& b, double tol) {
    double worst = 0, norm = 0;
    for (size_t k = 0; k < a.size(); ++k) {
      worst = std::max(worst, std::fabs(a[k] - b[k]));
      norm = std::max(norm, std::fabs(b[k]));
    }
    return worst <= tol * norm;
  };
  // s was rounded to fp32 for grad_output: relative 2^-24.
  EXPECT_TRUE(near_all(scaled.dx, upstream.dx, 1e-6));
  EXPECT_TRUE(near_all(scaled.dw, upstream.dw, 1e-6));
  EXPECT_TRUE(near_all(scaled.db, upstream.db, 1e-6));
  EXPECT_FALSE(near_all(plain.dx, upstream.dx, 1e-2));  // the scaling changes dX visibly
  // Mean: the cross-entropy part over the weight sum, the z-loss part over the count, each
  // row weighed by its s.
  LossProblem m = rp.problem();
  m.options.reduction = Reduction::kMean;
  m.options.token_scaling = true;
  ReferenceOutputs mean;
  ASSERT_TRUE(ReferenceCompute(m, &mean).ok());
  EXPECT_NEAR(mean.loss[0], ce_sum / w_sum + z_sum / n, 1e-12);
  EXPECT_NEAR(mean.z_loss[0], z_sum / n, 1e-12);
}

TEST(ReferenceTest, RejectsBadInput) {
  const float x[3] = {1, 2, 3};
  const float w[6] = {1, -1, 2, -2, 3, -3};
  int64_t target = 2;  // V = 2: out of range
  LossProblem p = F32Problem(1, 3, 2, x, w, &target);
  // The reference assumes a validated problem: what it is never handed, the one validation
  // (core/loss_problem_check.h) refuses.
  absl::Status st = ValidateLossInputs(p);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("targets[0] = 2"), std::string::npos) << st;
  p.v = 0;
  EXPECT_EQ(ValidateLossInputs(p).code(), absl::StatusCode::kInvalidArgument);
  // What it cannot do with a valid problem, it refuses itself.
  p.v = 2;
  target = 1;
  ASSERT_TRUE(ValidateLossInputs(p).ok());
  p.w_memory = Memory::kBackend;
  ReferenceOutputs r;
  EXPECT_EQ(ReferenceCompute(p, &r).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace lossd
