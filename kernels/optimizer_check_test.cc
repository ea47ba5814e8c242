// SPDX-License-Identifier: Apache-2.0
// CheckOptimizerStep and CheckSumOfSquares: each refusal's code and the field its message
// names, and the edge cases that must pass (n = 0 with null buffers, no copy).
#include "kernels/optimizer_check.h"

#include <cmath>
#include <limits>
#include <string>

#include "gtest/gtest.h"
#include "kernels/optimizer.h"

namespace lossd {
namespace {

float g_buf[4][2] = {{1, 2}, {3, 4}, {5, 6}, {7, 8}};

OptimizerTensors Full() {
  OptimizerTensors t;
  t.n = 2;
  t.param = g_buf[0];
  t.grad = g_buf[1];
  t.state1 = g_buf[2];
  t.state2 = g_buf[3];
  t.state3 = g_buf[2];
  return t;
}

void ExpectRefused(const OptimizerParams& p, const OptimizerTensors& t, const std::string& what) {
  const absl::Status s = CheckOptimizerStep(p, t);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << what;
  EXPECT_NE(s.message().find(what), absl::string_view::npos) << s;
}

TEST(OptimizerCheckTest, AcceptsTheDefaultsAndEmptyBuffers) {
  EXPECT_TRUE(CheckOptimizerStep(OptimizerParams(), Full()).ok());
  OptimizerTensors empty;  // n = 0: every buffer may be null
  EXPECT_TRUE(CheckOptimizerStep(OptimizerParams(), empty).ok());
  OptimizerParams sgd;
  sgd.kind = OptimizerKind::kSgd;
  OptimizerTensors no_state = Full();
  no_state.state1 = no_state.state2 = no_state.state3 = nullptr;
  EXPECT_TRUE(CheckOptimizerStep(sgd, no_state).ok());  // momentum 0 needs no buffer
}

TEST(OptimizerCheckTest, RefusesScalarsTorchRefuses) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  OptimizerParams p;
  p.lr = -1;
  ExpectRefused(p, Full(), "lr is -1");
  p = OptimizerParams();
  p.lr = nan;
  ExpectRefused(p, Full(), "lr is nan");
  p = OptimizerParams();
  p.weight_decay = -0.1;
  ExpectRefused(p, Full(), "weight_decay is -0.1");
  p = OptimizerParams();
  p.beta1 = 1;
  ExpectRefused(p, Full(), "beta1 is 1");
  p = OptimizerParams();
  p.beta2 = -0.5;
  ExpectRefused(p, Full(), "beta2 is -0.5");
  p = OptimizerParams();
  p.eps = -1e-8;
  ExpectRefused(p, Full(), "eps is");
  p = OptimizerParams();
  p.step = 0;
  ExpectRefused(p, Full(), "step is 0");
  p = OptimizerParams();
  p.grad_scale = std::numeric_limits<float>::infinity();
  ExpectRefused(p, Full(), "grad_scale is inf");
  p = OptimizerParams();
  p.kind = static_cast<OptimizerKind>(7);
  ExpectRefused(p, Full(), "kind is 7");
  p = OptimizerParams();
  p.kind = OptimizerKind::kSgd;
  p.momentum = -0.9;
  ExpectRefused(p, Full(), "momentum is -0.9");
  p.momentum = 0;
  p.nesterov = true;
  ExpectRefused(p, Full(), "nesterov needs momentum > 0 and dampening 0");
  p.momentum = 0.9;
  p.dampening = 0.1;
  ExpectRefused(p, Full(), "dampening 0.1");
  p.dampening = nan;
  p.nesterov = false;
  ExpectRefused(p, Full(), "dampening is nan");
}

TEST(OptimizerCheckTest, RefusesMissingBuffers) {
  OptimizerParams adamw;
  OptimizerTensors t = Full();
  t.n = -3;
  ExpectRefused(adamw, t, "n is -3");
  t = Full();
  t.param = nullptr;
  ExpectRefused(adamw, t, "param is null for n = 2");
  t = Full();
  t.grad = nullptr;
  ExpectRefused(adamw, t, "grad is null");
  t = Full();
  t.state2 = nullptr;
  ExpectRefused(adamw, t, "state2 is null");
  t = Full();
  t.state3 = nullptr;
  EXPECT_TRUE(CheckOptimizerStep(adamw, t).ok());  // no amsgrad: max_exp_avg_sq unused
  adamw.amsgrad = true;
  ExpectRefused(adamw, t, "state3 is null");
  OptimizerParams sgd;
  sgd.kind = OptimizerKind::kSgd;
  sgd.momentum = 0.5;
  t = Full();
  t.state1 = nullptr;
  ExpectRefused(sgd, t, "state1 is null");
  t = Full();
  t.copy = g_buf[0];
  t.copy_dtype = DType::kI32;
  ExpectRefused(OptimizerParams(), t, "copy_dtype is int32");
}

TEST(OptimizerCheckTest, SumOfSquaresArguments) {
  EXPECT_TRUE(CheckSumOfSquares(nullptr, 0).ok());
  EXPECT_TRUE(CheckSumOfSquares(g_buf[0], 2).ok());
  EXPECT_EQ(CheckSumOfSquares(nullptr, 1).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CheckSumOfSquares(g_buf[0], -1).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace lossd
