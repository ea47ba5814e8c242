// SPDX-License-Identifier: Apache-2.0
// The CPU backend's optimizer step against the float64 oracle: every option combination of
// SGD and AdamW (testing/optimizer_cases.h), odd sizes, several steps with the state carried,
// errors within the fp32 table; the compute copy the exact cast of the master; results the
// same at any thread count. Then SumOfSquares against a double loop, Inf and NaN included.
#include "kernels/cpu/optimizer_step.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "core/dtype.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/optimizer_reference.h"
#include "kernels/optimizer.h"
#include "testing/optimizer_cases.h"

namespace lossd {
namespace {

std::vector<double> Widen(const std::vector<float>& v) { return {v.begin(), v.end()}; }

// Mismatches between the copy and the cast of param, with the first one's index.
std::string CopyMismatches(const OptimizerCase& c, const OptimizerBuffers& b) {
  if (!c.copy) {
    for (const uint8_t byte : b.copy) {
      if (byte != 0xFF) return "copy written though none was asked for";
    }
    return "";
  }
  const size_t width = DTypeSize(c.copy_dtype);
  std::vector<uint8_t> want(b.copy.size(), 0xFF);
  int64_t bad = 0, first = -1;
  for (int64_t i = 0; i < b.n; ++i) {
    StoreFromFloat(want.data(), c.copy_dtype, i, b.param[i]);
    if (std::memcmp(want.data() + i * width, b.copy.data() + i * width, width) != 0) {
      if (first < 0) first = i;
      ++bad;
    }
  }
  return bad == 0 ? "" : absl::StrCat(bad, " copy elements differ from the cast, first ", first);
}

struct Worst {
  double param = 0, state1 = 0, state2 = 0;
};
Worst g_worst;  // over every case, printed at the end: how far below the table the errors are

class OptimizerStepTest
    : public ::testing::TestWithParam<std::tuple<OptimizerCase, int64_t>> {
 protected:
  static void TearDownTestSuite() {
    std::printf("worst fp32 error vs the oracle, ulps: param %.2f (table %.0f), state1 %.2f "
                "(%.0f), state2 %.2f (%.0f)\n",
                g_worst.param, kParamUlps, g_worst.state1, kState1Ulps, g_worst.state2,
                kState2Ulps);
  }
};

TEST_P(OptimizerStepTest, MatchesTheFloat64OracleOverSteps) {
  const OptimizerCase& c = std::get<0>(GetParam());
  const int64_t n = std::get<1>(GetParam());
  std::unique_ptr<Backend> backend = NewCpuBackend(3);
  OptimizerBuffers b = RandomOptimizerBuffers(c, n, 17 + n);
  std::vector<double> param = Widen(b.param), s1 = Widen(b.state1), s2 = Widen(b.state2),
                      s3 = Widen(b.state3);
  const bool adamw = c.params.kind == OptimizerKind::kAdamW;
  const bool has_s1 = adamw || c.params.momentum != 0;
  for (int k = 0; k < kOptimizerSteps; ++k) {
    SCOPED_TRACE(absl::StrCat("step ", k));
    const OptimizerParams p = ParamsAtStep(c.params, k);
    const std::vector<float> grad = RandomGradient(n, 1000 * k + n);
    const std::vector<double> grad64 = Widen(grad);
    std::fill(b.copy.begin(), b.copy.end(), 0xFF);
    ASSERT_TRUE(backend->OptimizerStep(p, HostTensors(c, b, grad.data())).ok());
    ReferenceOptimizerStep(p, n, param.data(), grad64.data(), s1.data(), s2.data(), s3.data());

    const double pu = NormwiseUlps(b.param, param);
    EXPECT_LE(pu, kParamUlps) << "param";
    g_worst.param = std::max(g_worst.param, pu);
    if (has_s1) {
      const double u = NormwiseUlps(b.state1, s1);
      EXPECT_LE(u, kState1Ulps) << "state1";
      g_worst.state1 = std::max(g_worst.state1, u);
    }
    if (adamw) {
      const double u = ElementwiseUlps(b.state2, s2);
      EXPECT_LE(u, kState2Ulps) << "state2";
      g_worst.state2 = std::max(g_worst.state2, u);
      if (c.params.amsgrad) {
        EXPECT_LE(ElementwiseUlps(b.state3, s3), kState2Ulps) << "state3";
      }
    }
    EXPECT_EQ(CopyMismatches(c, b), "");
  }
}

// Every element is written. With every |g| >= 0.35 (a gradient away from zero), one step
// moves every SGD parameter by at least lr*0.35 (far above an fp32 ulp of |p| <= 1) and
// every AdamW exp_avg_sq by (1 - beta2)*g^2, far above an ulp of its old value.
TEST_P(OptimizerStepTest, WritesEveryElement) {
  const OptimizerCase& c = std::get<0>(GetParam());
  const int64_t n = std::get<1>(GetParam());
  OptimizerBuffers b = RandomOptimizerBuffers(c, n, 29);
  const OptimizerBuffers start = b;
  std::vector<float> grad = RandomGradient(n, 30);
  for (float& g : grad) g = std::copysign(0.5f + std::fabs(g), g);
  ASSERT_TRUE(NewCpuBackend(3)->OptimizerStep(c.params, HostTensors(c, b, grad.data())).ok());
  int64_t unwritten = 0;
  for (int64_t i = 0; i < n; ++i) {
    unwritten += c.params.kind == OptimizerKind::kAdamW ? b.state2[i] == start.state2[i]
                                                        : b.param[i] == start.param[i];
  }
  EXPECT_EQ(unwritten, 0);
}

std::vector<std::tuple<OptimizerCase, int64_t>> Matrix() {
  std::vector<std::tuple<OptimizerCase, int64_t>> out;
  for (const OptimizerCase& c : AllOptimizerCases()) {
    // 70001 spans two of the CPU backend's task blocks, so more than one thread works.
    for (const int64_t n : {1, 7, 1031, 70001}) out.emplace_back(c, n);
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(
    AllOptions, OptimizerStepTest, ::testing::ValuesIn(Matrix()),
    [](const ::testing::TestParamInfo<std::tuple<OptimizerCase, int64_t>>& info) {
      return absl::StrCat(std::get<0>(info.param).name, "_n", std::get<1>(info.param));
    });

TEST(OptimizerStepThreadsTest, OneThreadAndFourAgreeBitForBit) {
  const int64_t n = 300007;
  for (const OptimizerCase& c : AllOptimizerCases()) {
    SCOPED_TRACE(c.name);
    OptimizerBuffers one = RandomOptimizerBuffers(c, n, 5), four = RandomOptimizerBuffers(c, n, 5);
    const std::vector<float> grad = RandomGradient(n, 6);
    const OptimizerParams p = ParamsAtStep(c.params, 0);
    ASSERT_TRUE(NewCpuBackend(1)->OptimizerStep(p, HostTensors(c, one, grad.data())).ok());
    ASSERT_TRUE(NewCpuBackend(4)->OptimizerStep(p, HostTensors(c, four, grad.data())).ok());
    EXPECT_EQ(CountNan(one.param), 0);
    EXPECT_EQ(std::memcmp(one.param.data(), four.param.data(), n * 4), 0);
    EXPECT_EQ(std::memcmp(one.state1.data(), four.state1.data(), n * 4), 0);
    EXPECT_EQ(std::memcmp(one.state2.data(), four.state2.data(), n * 4), 0);
    EXPECT_EQ(std::memcmp(one.state3.data(), four.state3.data(), n * 4), 0);
    EXPECT_EQ(one.copy, four.copy);
  }
}

TEST(OptimizerStepCheckTest, RefusesWhatTorchWould) {
  std::unique_ptr<Backend> backend = NewCpuBackend(1);
  float x = 1;
  OptimizerTensors t;
  t.n = 1;
  t.param = &x;
  t.grad = &x;
  OptimizerParams p;  // AdamW: exp_avg and exp_avg_sq missing
  const absl::Status s = backend->OptimizerStep(p, t);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("state1"), absl::string_view::npos) << s;
  EXPECT_EQ(x, 1);  // nothing written
}

// SumOfSquares: every product is exact in double, so the only rounding is the sum's; any
// order of n non-negative terms is within (n - 1) * 2^-53 * sum of the index-order sum
// (each partial sum is at most the total).
double SumBound(double sum, int64_t n) { return 2.0 * (n - 1) * std::ldexp(1.0, -53) * sum; }

TEST(SumOfSquaresTest, MatchesADoubleLoop) {
  std::unique_ptr<Backend> backend = NewCpuBackend(3);
  for (const int64_t n : {0, 1, 7, 1031, 65536, 300007}) {
    SCOPED_TRACE(n);
    const std::vector<float> x = RandomGradient(n, 40 + n);
    const absl::StatusOr<double> got = backend->SumOfSquares(x.data(), n);
    ASSERT_TRUE(got.ok()) << got.status();
    const double want = ReferenceSumOfSquares(x.data(), n);
    EXPECT_LE(std::fabs(*got - want), SumBound(want, n)) << *got << " vs " << want;
    if (n > 0) {
      EXPECT_GT(*got, 0);
    }
    EXPECT_EQ(*got, *NewCpuBackend(1)->SumOfSquares(x.data(), n));  // thread count: same bits
  }
}

TEST(SumOfSquaresTest, LargeValuesDoNotOverflowInDouble) {
  const std::vector<float> x = {3e38f, -3e38f};
  const absl::StatusOr<double> got = NewCpuBackend(1)->SumOfSquares(x.data(), 2);
  ASSERT_TRUE(got.ok());
  const double big = 3e38f;
  EXPECT_EQ(*got, 2 * big * big);  // about 1.8e77: far past fp32's range, well inside double's
  EXPECT_TRUE(std::isfinite(*got));
}

TEST(SumOfSquaresTest, InfAndNanPropagate) {
  std::unique_ptr<Backend> backend = NewCpuBackend(3);
  const int64_t n = 200003;
  std::vector<float> x = RandomGradient(n, 3);
  x[n - 1] = std::numeric_limits<float>::infinity();
  EXPECT_EQ(*backend->SumOfSquares(x.data(), n), std::numeric_limits<double>::infinity());
  x[n - 1] = -std::numeric_limits<float>::infinity();
  EXPECT_EQ(*backend->SumOfSquares(x.data(), n), std::numeric_limits<double>::infinity());
  x[70000] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_TRUE(std::isnan(*backend->SumOfSquares(x.data(), n)));  // NaN wins over Inf
  x[n - 1] = 1;
  EXPECT_TRUE(std::isnan(*backend->SumOfSquares(x.data(), n)));
}

TEST(SumOfSquaresTest, RefusesBadArguments) {
  std::unique_ptr<Backend> backend = NewCpuBackend(1);
  EXPECT_EQ(backend->SumOfSquares(nullptr, 3).status().code(),
            absl::StatusCode::kInvalidArgument);
  float x = 1;
  EXPECT_EQ(backend->SumOfSquares(&x, -1).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(*backend->SumOfSquares(nullptr, 0), 0);
}

}  // namespace
}  // namespace lossd
