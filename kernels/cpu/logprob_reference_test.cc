// SPDX-License-Identifier: Apache-2.0
// Tests of the float64 log-prob / entropy reference: every gradient against central finite
// differences of its own outputs over every option combination, and hand-checkable cases
// (T = 1 is minus the cross-entropy reference's per-token loss; T = 2 is W / 2; entropies).
#include "kernels/cpu/logprob_reference.h"

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "gtest/gtest.h"
#include "core/dtype.h"
#include "core/loss_problem.h"
#include "kernels/cpu/reference.h"
#include "kernels/cpu/reference_head.h"
#include "testing/finite_difference.h"

namespace lossd {
namespace {

// Random fp32 inputs of one head, owned, in [-1, 1) (never zero-filled).
struct Inputs {
  int64_t bt, h, v;
  std::vector<float> x, w, b;
  std::vector<int64_t> targets;
  std::vector<float> dlogp, dentropy;

  Inputs(int64_t bt_, int64_t h_, int64_t v_, uint32_t seed) : bt(bt_), h(h_), v(v_) {
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    x.resize(bt * h);
    w.resize(v * h);
    b.resize(v);
    dlogp.resize(bt);
    dentropy.resize(bt);
    for (auto* a : {&x, &w, &b, &dlogp, &dentropy}) {
      for (float& e : *a) e = u(rng);
    }
    std::uniform_int_distribution<int64_t> t(0, v - 1);
    targets.resize(bt);
    for (int64_t& e : targets) e = t(rng);
    targets[bt - 1] = v - 1;  // the last class is a target somewhere
  }

  LogprobProblem Problem(bool bias) {
    LogprobProblem p;
    p.head = HeadInputs{bt, h, v, DType::kF32, x.data(), w.data(), bias ? b.data() : nullptr};
    p.targets = targets.data();
    p.dlogp = dlogp.data();
    p.dentropy = dentropy.data();
    return p;
  }
};

enum Upstream { kLogpOnly, kEntropyOnly, kBoth };

using FdParam = std::tuple<float /*temperature*/, float /*softcap*/, bool /*bias*/,
                           bool /*ignore*/, Upstream>;

class LogprobFiniteDifferenceTest : public ::testing::TestWithParam<FdParam> {};

TEST_P(LogprobFiniteDifferenceTest, GradientsMatchFiniteDifferences) {
  const auto [temperature, softcap, bias, ignore, upstream] = GetParam();
  Inputs in(5, 3, 7, 7);
  if (ignore) in.targets[1] = -100;
  LogprobProblem p = in.Problem(bias);
  p.options.temperature = temperature;
  p.options.softcap = softcap;
  if (upstream == kEntropyOnly) p.dlogp = nullptr;
  if (upstream == kLogpOnly) p.dentropy = nullptr;
  LogprobReferenceOutputs r;
  ASSERT_TRUE(LogprobReference(p, &r).ok());
  ASSERT_EQ(r.grad.db.size(), bias ? 7u : 0u);
  EXPECT_EQ(r.tokens, ignore ? 4 : 5);

  // F = sum_i dlogp_i logp_i + dentropy_i H_i, the scalar whose gradient the reference returns.
  auto objective = [&]() {
    LogprobReferenceOutputs o;
    EXPECT_TRUE(LogprobReference(p, &o).ok());
    double f = 0;
    for (int64_t i = 0; i < in.bt; ++i) {
      if (p.dlogp != nullptr) f += p.dlogp[i] * o.logp[i];
      if (p.dentropy != nullptr) f += p.dentropy[i] * o.entropy[i];
    }
    return f;
  };
  double largest = ExpectGradientMatches("dx", in.x.data(), r.grad.dx, objective);
  largest = std::max(largest, ExpectGradientMatches("dw", in.w.data(), r.grad.dw, objective));
  if (bias) ExpectGradientMatches("db", in.b.data(), r.grad.db, objective);
  EXPECT_GT(largest, 100 * kFdAtol);  // the comparisons above were not of zeros
  if (ignore) {
    EXPECT_EQ(r.logp[1], 0.0);
    EXPECT_EQ(r.entropy[1], 0.0);
    EXPECT_TRUE(std::isfinite(r.lse[1]) && r.lse[1] != 0.0);
    for (int64_t k = 0; k < in.h; ++k) EXPECT_EQ(r.grad.dx[1 * in.h + k], 0.0);
  }
  for (int64_t i = 0; i < in.bt; ++i) {
    if (i == 1 && ignore) continue;
    EXPECT_LT(r.logp[i], 0.0);
    EXPECT_GT(r.entropy[i], 0.0);
    EXPECT_LT(r.entropy[i], std::log(7.0) + 1e-12);
  }
}

std::string FdName(const ::testing::TestParamInfo<FdParam>& info) {
  const auto [t, cap, bias, ignore, up] = info.param;
  std::string name = "T" + std::to_string(static_cast<int>(t * 10)) +
                     (cap > 0 ? "_softcap" : "") + (bias ? "_bias" : "") +
                     (ignore ? "_ignore" : "");
  return name + (up == kLogpOnly ? "_dlogp" : up == kEntropyOnly ? "_dentropy" : "_both");
}

INSTANTIATE_TEST_SUITE_P(
    AllOptions, LogprobFiniteDifferenceTest,
    ::testing::Combine(::testing::Values(1.0f, 0.7f, 1.6f), ::testing::Values(0.0f, 2.5f),
                       ::testing::Bool(), ::testing::Bool(),
                       ::testing::Values(kLogpOnly, kEntropyOnly, kBoth)),
    FdName);

// At T = 1, -logp is the cross-entropy reference's per-token loss (reduction none), softcap
// included, and the dlogp gradient is its gradient with grad_output = -dlogp.
TEST(LogprobReferenceTest, AtTemperatureOneIsMinusTheCrossEntropy) {
  for (float softcap : {0.0f, 2.0f}) {
    Inputs in(6, 4, 9, 11);
    in.targets[2] = -100;
    LogprobProblem p = in.Problem(/*bias=*/true);
    p.options.softcap = softcap;
    p.dentropy = nullptr;
    LogprobReferenceOutputs r;
    ASSERT_TRUE(LogprobReference(p, &r).ok());

    std::vector<float> minus_dlogp(in.bt);
    for (int64_t i = 0; i < in.bt; ++i) minus_dlogp[i] = -in.dlogp[i];  // exact in fp32
    LossProblem ce;
    ce.bt = in.bt;
    ce.h = in.h;
    ce.v = in.v;
    ce.dtype = DType::kF32;
    ce.x = in.x.data();
    ce.w = in.w.data();
    ce.bias = in.b.data();
    ce.targets = in.targets.data();
    ce.grad_output = minus_dlogp.data();
    ce.options.reduction = Reduction::kNone;
    ce.options.softcap = softcap;
    ReferenceOutputs c;
    ASSERT_TRUE(ReferenceCompute(ce, &c).ok());
    EXPECT_EQ(r.tokens, c.tokens);
    for (int64_t i = 0; i < in.bt; ++i) {
      EXPECT_NEAR(r.logp[i], -c.loss[i], 1e-14) << i;
      EXPECT_NEAR(r.lse[i], c.lse[i], 1e-14) << i;
    }
    EXPECT_EQ(r.logp[2], 0.0);
    EXPECT_NE(c.lse[2], 0.0);
    for (size_t k = 0; k < r.grad.dx.size(); ++k) EXPECT_NEAR(r.grad.dx[k], c.dx[k], 1e-14);
    for (size_t k = 0; k < r.grad.dw.size(); ++k) EXPECT_NEAR(r.grad.dw[k], c.dw[k], 1e-14);
    for (size_t k = 0; k < r.grad.db.size(); ++k) EXPECT_NEAR(r.grad.db[k], c.db[k], 1e-14);
  }
}

// Dividing by T = 2 is the same as halving W and b (exact in binary): bit-identical outputs.
TEST(LogprobReferenceTest, TemperatureTwoIsHalfTheWeights) {
  Inputs in(4, 5, 6, 3);
  LogprobProblem p = in.Problem(true);
  p.options.temperature = 2.0f;
  LogprobReferenceOutputs hot, half;
  ASSERT_TRUE(LogprobReference(p, &hot).ok());
  Inputs halved = in;
  for (float& e : halved.w) e *= 0.5f;
  for (float& e : halved.b) e *= 0.5f;
  ASSERT_TRUE(LogprobReference(halved.Problem(true), &half).ok());
  EXPECT_EQ(hot.logp, half.logp);
  EXPECT_EQ(hot.entropy, half.entropy);
  EXPECT_EQ(hot.lse, half.lse);
  // dX at T = 2 is dz/dx = W / 2, the halved head's exactly.
  EXPECT_EQ(hot.grad.dx, half.grad.dx);
  // The temperature visibly changes the result: the comparison above can fail.
  LogprobReferenceOutputs cold;
  ASSERT_TRUE(LogprobReference(in.Problem(true), &cold).ok());
  EXPECT_GT(std::fabs(cold.entropy[0] - hot.entropy[0]), 1e-3);
}

// Hand-computed: H = 3, V = 4, x = e_0 picks W's column 0 as the logits.
//   row 0: logits (0, 0, 0, 0):        logp = -ln 4, H = ln 4
//   row 1: logits (ln 3, 0, -inf-ish): W column 0 = (ln 3, 0, 0, 0) with target 0:
//          p = (3/6, 1/6, 1/6, 1/6), logp = ln(1/2), H = -(1/2 ln 1/2 + 3 (1/6) ln 1/6)
TEST(LogprobReferenceTest, HandComputedEntropies) {
  const float ln3 = std::log(3.0f);
  const float x[6] = {0, 1, 0, 1, 0, 0};  // row 0 picks column 1 (zeros), row 1 column 0
  const float w[12] = {ln3, 0, 2, 0, 0, -1, 0, 0, 5, 0, 0, 3};
  const int64_t targets[2] = {3, 0};
  LogprobProblem p;
  p.head = HeadInputs{2, 3, 4, DType::kF32, x, w, nullptr};
  p.targets = targets;
  LogprobReferenceOutputs r;
  ASSERT_TRUE(LogprobReference(p, &r).ok());
  EXPECT_NEAR(r.logp[0], -std::log(4.0), 1e-15);
  EXPECT_NEAR(r.entropy[0], std::log(4.0), 1e-15);
  // ln3 is rounded to fp32: p_0 = 3' / (3' + 3) with 3' = exp(float(ln 3)).
  const double e3 = std::exp(static_cast<double>(ln3));
  const double p0 = e3 / (e3 + 3), p1 = 1 / (e3 + 3);
  EXPECT_NEAR(r.logp[1], std::log(p0), 1e-15);
  EXPECT_NEAR(r.logp[1], std::log(0.5), 1e-7);
  EXPECT_NEAR(r.entropy[1], -(p0 * std::log(p0) + 3 * p1 * std::log(p1)), 1e-15);
  for (double g : r.grad.dx) EXPECT_EQ(g, 0.0);  // no upstream gradients given
}

TEST(LogprobReferenceTest, HalfInputsAreWidenedExactly) {
  Inputs in(5, 4, 6, 5);
  std::vector<uint16_t> xb(in.x.size()), wb(in.w.size());
  for (size_t k = 0; k < xb.size(); ++k) {
    xb[k] = FloatToBf16(in.x[k]);
    in.x[k] = Bf16ToFloat(xb[k]);
  }
  for (size_t k = 0; k < wb.size(); ++k) {
    wb[k] = FloatToBf16(in.w[k]);
    in.w[k] = Bf16ToFloat(wb[k]);
  }
  LogprobProblem f32 = in.Problem(false);
  LogprobProblem bf16 = f32;
  bf16.head.dtype = DType::kBF16;
  bf16.head.x = xb.data();
  bf16.head.w = wb.data();
  f32.options.temperature = bf16.options.temperature = 0.6f;
  LogprobReferenceOutputs a, b;
  ASSERT_TRUE(LogprobReference(f32, &a).ok());
  ASSERT_TRUE(LogprobReference(bf16, &b).ok());
  EXPECT_EQ(a.logp, b.logp);
  EXPECT_EQ(a.entropy, b.entropy);
  EXPECT_EQ(a.grad.dx, b.grad.dx);
  EXPECT_EQ(a.grad.dw, b.grad.dw);
}

TEST(LogprobReferenceTest, RejectsBadInput) {
  Inputs in(2, 3, 4, 1);
  auto expect_refused = [&](LogprobProblem p, const std::string& substring) {
    LogprobReferenceOutputs r;
    const absl::Status st = LogprobReference(p, &r);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << substring;
    EXPECT_NE(st.message().find(substring), std::string::npos) << st;
  };
  LogprobProblem p = in.Problem(false);
  LogprobReferenceOutputs ok;
  ASSERT_TRUE(LogprobReference(p, &ok).ok());
  p.options.temperature = 0.0f;
  expect_refused(p, "options.temperature must be finite and > 0, got 0");
  p.options.temperature = NAN;
  expect_refused(p, "options.temperature");
  p = in.Problem(false);
  p.options.softcap = -1.0f;
  expect_refused(p, "options.softcap must be finite and >= 0 (0 = off), got -1");
  p = in.Problem(false);
  in.targets[1] = 4;
  expect_refused(p, "targets[1] = 4 is outside [0, 4)");
  in.targets[1] = -100;
  ASSERT_TRUE(LogprobReference(p, &ok).ok());  // ignore_index is fine
  in.dlogp[0] = INFINITY;
  expect_refused(p, "dlogp[0] must be finite, got inf");
  p = in.Problem(false);
  p.dlogp = nullptr;
  p.head.dtype = DType::kI32;
  expect_refused(p, "head: dtype must be bf16, fp16 or fp32, got int32");
  p = in.Problem(false);
  p.dlogp = nullptr;
  p.head.v = 0;
  expect_refused(p, "head: shape (bt, h, v) must be positive, got (2, 3, 0)");
}

}  // namespace
}  // namespace lossd
