// SPDX-License-Identifier: Apache-2.0
// Tests of the float64 optimizer oracle: steps worked out by hand for one to three elements
// per option (the arithmetic is written beside each expectation), then properties that tie
// the options together (lr = 0, weight decay alone, nesterov, the gradient scale).
#include "kernels/cpu/optimizer_reference.h"

#include <cmath>
#include <cstdint>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/optimizer.h"

namespace lossd {
namespace {

// Hand values are exact decimal arithmetic; the oracle rounds a few times in double.
constexpr double kTol = 1e-15;

OptimizerParams Sgd(double lr) {
  OptimizerParams p;
  p.kind = OptimizerKind::kSgd;
  p.lr = lr;
  return p;
}

OptimizerParams AdamW(double lr, double beta1, double beta2, double eps, int64_t step) {
  OptimizerParams p;
  p.kind = OptimizerKind::kAdamW;
  p.lr = lr;
  p.beta1 = beta1;
  p.beta2 = beta2;
  p.eps = eps;
  p.step = step;
  return p;
}

TEST(OptimizerReferenceTest, SgdPlain) {
  // p -= 0.1*g: 1 - 0.1*0.5 = 0.95; -2 - 0.1*4 = -2.4.
  double param[2] = {1, -2};
  const double grad[2] = {0.5, 4};
  ReferenceOptimizerStep(Sgd(0.1), 2, param, grad, nullptr, nullptr, nullptr);
  EXPECT_NEAR(param[0], 0.95, kTol);
  EXPECT_NEAR(param[1], -2.4, kTol);
}

TEST(OptimizerReferenceTest, SgdWeightDecayIsCoupled) {
  // g = 1 + 0.01*2 = 1.02; p = 2 - 0.1*1.02 = 1.898.
  OptimizerParams p = Sgd(0.1);
  p.weight_decay = 0.01;
  double param[1] = {2};
  const double grad[1] = {1};
  ReferenceOptimizerStep(p, 1, param, grad, nullptr, nullptr, nullptr);
  EXPECT_NEAR(param[0], 1.898, kTol);
}

TEST(OptimizerReferenceTest, SgdGradScale) {
  // g = 0.5*4 = 2; p = 1 - 0.1*2 = 0.8.
  OptimizerParams p = Sgd(0.1);
  p.grad_scale = 0.5f;
  double param[1] = {1};
  const double grad[1] = {4};
  ReferenceOptimizerStep(p, 1, param, grad, nullptr, nullptr, nullptr);
  EXPECT_NEAR(param[0], 0.8, kTol);
}

TEST(OptimizerReferenceTest, SgdMomentumFirstThenLaterStep) {
  OptimizerParams p = Sgd(0.1);
  p.momentum = 0.9;
  p.dampening = 0.5;
  // First step: buf = g = 2 (a clone, no dampening); p = 1 - 0.1*2 = 0.8.
  double param[1] = {1};
  double buf[1] = {123};  // whatever was there is ignored before the first step
  const double g1[1] = {2};
  ReferenceOptimizerStep(p, 1, param, g1, buf, nullptr, nullptr);
  EXPECT_EQ(buf[0], 2);
  EXPECT_NEAR(param[0], 0.8, kTol);
  // Second: buf = 0.9*2 + (1-0.5)*1 = 2.3; p = 0.8 - 0.1*2.3 = 0.57.
  p.momentum_initialised = true;
  const double g2[1] = {1};
  ReferenceOptimizerStep(p, 1, param, g2, buf, nullptr, nullptr);
  EXPECT_NEAR(buf[0], 2.3, kTol);
  EXPECT_NEAR(param[0], 0.57, kTol);
}

TEST(OptimizerReferenceTest, SgdNesterov) {
  // buf = 0.9*2 + 1 = 2.8; g = 1 + 0.9*2.8 = 3.52; p = 1 - 0.1*3.52 = 0.648.
  // Second element: buf = 0.9*(-1) + 3 = 2.1; g = 3 + 0.9*2.1 = 4.89; p = 0 - 0.489.
  OptimizerParams p = Sgd(0.1);
  p.momentum = 0.9;
  p.nesterov = true;
  p.momentum_initialised = true;
  double param[2] = {1, 0};
  double buf[2] = {2, -1};
  const double grad[2] = {1, 3};
  ReferenceOptimizerStep(p, 2, param, grad, buf, nullptr, nullptr);
  EXPECT_NEAR(buf[0], 2.8, kTol);
  EXPECT_NEAR(buf[1], 2.1, kTol);
  EXPECT_NEAR(param[0], 0.648, kTol);
  EXPECT_NEAR(param[1], -0.489, kTol);
}

TEST(OptimizerReferenceTest, AdamWFirstStepIsLrTimesSign) {
  // beta1 = 0.5, beta2 = 0.75, eps = 1e-3, lr = 0.1, step 1, m = v = 0:
  // m = 0.5*g, v = 0.25*g^2, bc1 = 0.5, sqrt(bc2) = sqrt(0.25) = 0.5, step_size = 0.1/0.5 = 0.2;
  // denom = (|g|/2)/0.5 + 1e-3 = |g| + 1e-3; update = 0.2*(g/2)/(|g| + 1e-3).
  //   g = 2:    m = 1, v = 1, p = 1 - 0.2/2.001;
  //   g = -0.5: m = -0.25, v = 0.0625, p = 3 + 0.05/0.501;
  //   g = 0:    m = v = 0, p unchanged.
  const OptimizerParams p = AdamW(0.1, 0.5, 0.75, 1e-3, 1);
  double param[3] = {1, 3, -1};
  const double grad[3] = {2, -0.5, 0};
  double m[3] = {0, 0, 0}, v[3] = {0, 0, 0};
  ReferenceOptimizerStep(p, 3, param, grad, m, v, nullptr);
  EXPECT_NEAR(m[0], 1, kTol);
  EXPECT_NEAR(m[1], -0.25, kTol);
  EXPECT_EQ(m[2], 0);
  EXPECT_NEAR(v[0], 1, kTol);
  EXPECT_NEAR(v[1], 0.0625, kTol);
  EXPECT_EQ(v[2], 0);
  EXPECT_NEAR(param[0], 1 - 0.2 / 2.001, kTol);
  EXPECT_NEAR(param[1], 3 + 0.05 / 0.501, kTol);
  EXPECT_EQ(param[2], -1);
}

TEST(OptimizerReferenceTest, AdamWSecondStepWithDecayAndScale) {
  // Step 2, beta1 = 0.5, beta2 = 0.75, eps = 0, lr = 0.1, wd = 0.2, grad_scale = 0.5:
  // g = 0.5*8 = 4; p = 1*(1 - 0.1*0.2) = 0.98; m = 1 + 0.5*(4 - 1) = 2.5;
  // v = 0.75*1 + 0.25*16 = 4.75; bc1 = 1 - 0.25 = 0.75; bc2 = 1 - 0.5625 = 0.4375;
  // p = 0.98 - (0.1/0.75)*2.5/(sqrt(4.75)/sqrt(0.4375)).
  OptimizerParams p = AdamW(0.1, 0.5, 0.75, 0, 2);
  p.weight_decay = 0.2;
  p.grad_scale = 0.5f;
  double param[1] = {1};
  const double grad[1] = {8};
  double m[1] = {1}, v[1] = {1};
  ReferenceOptimizerStep(p, 1, param, grad, m, v, nullptr);
  EXPECT_NEAR(m[0], 2.5, kTol);
  EXPECT_NEAR(v[0], 4.75, kTol);
  EXPECT_NEAR(param[0], 0.98 - (0.1 / 0.75) * 2.5 / std::sqrt(4.75 / 0.4375), kTol);
}

TEST(OptimizerReferenceTest, AdamWAmsgradUsesTheRunningMax) {
  // As above without decay or scale, g = 4: v = 4.75 for both elements.
  //   vmax = 5 stays 5: p = 1 - (0.1/0.75)*2.5/sqrt(5/0.4375);
  //   vmax = 1 becomes 4.75: p = 1 - (0.1/0.75)*2.5/sqrt(4.75/0.4375).
  OptimizerParams p = AdamW(0.1, 0.5, 0.75, 0, 2);
  p.amsgrad = true;
  double param[2] = {1, 1};
  const double grad[2] = {4, 4};
  double m[2] = {1, 1}, v[2] = {1, 1}, vmax[2] = {5, 1};
  ReferenceOptimizerStep(p, 2, param, grad, m, v, vmax);
  EXPECT_NEAR(v[0], 4.75, kTol);
  EXPECT_EQ(vmax[0], 5);
  EXPECT_NEAR(vmax[1], 4.75, kTol);
  EXPECT_NEAR(param[0], 1 - (0.1 / 0.75) * 2.5 / std::sqrt(5 / 0.4375), kTol);
  EXPECT_NEAR(param[1], 1 - (0.1 / 0.75) * 2.5 / std::sqrt(4.75 / 0.4375), kTol);
}

TEST(OptimizerReferenceTest, DefaultBetasFirstStep) {
  // torch's defaults (0.9, 0.999, 1e-8), lr = 0.1, g = 2: m = 0.2, v = 0.004, bc1 = 0.1,
  // sqrt(bc2) = sqrt(0.001); denom = sqrt(0.004)/sqrt(0.001) + 1e-8 = 2 + 1e-8;
  // p = 1 - (0.1/0.1)*0.2/(2 + 1e-8).
  const OptimizerParams p = AdamW(0.1, 0.9, 0.999, 1e-8, 1);
  double param[1] = {1};
  const double grad[1] = {2};
  double m[1] = {0}, v[1] = {0};
  ReferenceOptimizerStep(p, 1, param, grad, m, v, nullptr);
  EXPECT_NEAR(m[0], 0.2, kTol);
  EXPECT_NEAR(v[0], 0.004, kTol);
  EXPECT_NEAR(param[0], 1 - 0.2 / (2 + 1e-8), kTol);
}

TEST(OptimizerReferenceTest, ZeroLrLeavesParamsButMovesState) {
  const double grad[2] = {0.7, -1.3};
  for (const OptimizerKind kind : {OptimizerKind::kSgd, OptimizerKind::kAdamW}) {
    OptimizerParams p = kind == OptimizerKind::kSgd ? Sgd(0) : AdamW(0, 0.9, 0.99, 1e-8, 3);
    p.weight_decay = 0.1;
    p.momentum = 0.9;
    p.momentum_initialised = true;
    double param[2] = {0.25, -4};
    double s1[2] = {0.5, 0.5}, s2[2] = {0.5, 0.5};
    ReferenceOptimizerStep(p, 2, param, grad, s1, s2, nullptr);
    EXPECT_EQ(param[0], 0.25);
    EXPECT_EQ(param[1], -4);
    EXPECT_NE(s1[0], 0.5);  // SGD: 0.9*0.5 + (0.7 + 0.1*0.25); AdamW: 0.5 + 0.1*(0.7 - 0.5)
  }
}

TEST(OptimizerReferenceTest, WeightDecayAlone) {
  // A zero gradient: SGD p -= lr*wd*p; AdamW (fresh state, eps > 0) p *= 1 - lr*wd.
  const double grad[2] = {0, 0};
  OptimizerParams sgd = Sgd(0.5);
  sgd.weight_decay = 0.1;
  double a[2] = {2, -6};
  ReferenceOptimizerStep(sgd, 2, a, grad, nullptr, nullptr, nullptr);
  EXPECT_NEAR(a[0], 2 - 0.5 * 0.1 * 2, kTol);
  EXPECT_NEAR(a[1], -6 + 0.5 * 0.1 * 6, kTol);
  OptimizerParams adamw = AdamW(0.5, 0.9, 0.999, 1e-8, 1);
  adamw.weight_decay = 0.1;
  double b[2] = {2, -6}, m[2] = {0, 0}, v[2] = {0, 0};
  ReferenceOptimizerStep(adamw, 2, b, grad, m, v, nullptr);
  EXPECT_EQ(b[0], 2 * (1 - 0.05));
  EXPECT_EQ(b[1], -6 * (1 - 0.05));
}

TEST(OptimizerReferenceTest, NesterovDiffersFromPlainMomentum) {
  OptimizerParams p = Sgd(0.1);
  p.momentum = 0.9;
  p.momentum_initialised = true;
  const double grad[3] = {1, -2, 0.5};
  double plain[3] = {1, 2, 3}, buf_plain[3] = {0.3, 0.3, 0.3};
  double nest[3] = {1, 2, 3}, buf_nest[3] = {0.3, 0.3, 0.3};
  ReferenceOptimizerStep(p, 3, plain, grad, buf_plain, nullptr, nullptr);
  p.nesterov = true;
  ReferenceOptimizerStep(p, 3, nest, grad, buf_nest, nullptr, nullptr);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(buf_plain[i], buf_nest[i]) << i;  // the buffer is updated alike
    // nesterov steps by g + momentum*buf instead of buf: a difference of lr*(g - (1-m)*buf).
    EXPECT_NEAR(plain[i] - nest[i], 0.1 * (grad[i] - 0.1 * buf_plain[i]), 1e-14) << i;
    EXPECT_NE(plain[i], nest[i]) << i;
  }
}

TEST(OptimizerReferenceTest, AdamWGradScaleEqualsScaledGradient) {
  OptimizerParams p = AdamW(0.01, 0.9, 0.95, 1e-8, 5);
  p.grad_scale = 0.25f;
  double a[2] = {1, -1}, ma[2] = {0.1, -0.2}, va[2] = {0.3, 0.4};
  double b[2] = {1, -1}, mb[2] = {0.1, -0.2}, vb[2] = {0.3, 0.4};
  const double grad[2] = {3, -7}, quarter[2] = {0.75, -1.75};
  ReferenceOptimizerStep(p, 2, a, grad, ma, va, nullptr);
  p.grad_scale = 1.0f;
  ReferenceOptimizerStep(p, 2, b, quarter, mb, vb, nullptr);
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(a[i], b[i]);  // 0.25 is a power of two: scaling is exact
    EXPECT_EQ(ma[i], mb[i]);
    EXPECT_EQ(va[i], vb[i]);
  }
}

TEST(OptimizerReferenceTest, SumOfSquaresInIndexOrder) {
  const float x[3] = {3, -4, 0.5f};
  EXPECT_EQ(ReferenceSumOfSquares(x, 3), 25.25);  // 9 + 16 + 0.25
  EXPECT_EQ(ReferenceSumOfSquares(x, 0), 0);
}

}  // namespace
}  // namespace lossd
