// SPDX-License-Identifier: Apache-2.0
// The CPU backend against the float64 reference: a matrix of shapes x dtypes x options, edge
// cases, determinism, chunk-size invariance and the overlapped path (the interface around a
// Compute is cpu_backend_api_test).
#include "kernels/cpu/cpu_backend.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iostream>
#include <memory>
#include <ostream>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/status/status.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/cpu/reference.h"
#include "testing/test_util.h"
#include "core/dtype.h"
#include "core/loss_problem.h"

namespace lossd {
namespace {

struct Shape {
  const char* name;
  int64_t bt, h, v;
};

const Shape kShapes[] = {
    {"tiny", 2, 3, 5}, {"bt1", 1, 16, 37}, {"odd", 47, 31, 123}, {"medium", 256, 128, 1000}};

OptionCase Opt(const char* name) {
  OptionCase c;
  c.name = name;
  return c;
}

std::vector<OptionCase> OptionCases() {
  std::vector<OptionCase> cs;
  cs.push_back(Opt("mean"));
  OptionCase c = Opt("ignore");
  c.ignore = 0.3;
  cs.push_back(c);
  c = Opt("sum");
  c.reduction = Reduction::kSum;
  c.ignore = 0.1;
  cs.push_back(c);
  c = Opt("none");
  c.reduction = Reduction::kNone;
  c.ignore = 0.1;
  c.grad_output = true;
  cs.push_back(c);
  c = Opt("smoothing");
  c.eps = 0.1f;
  cs.push_back(c);
  c = Opt("zloss");
  c.zs = 1e-2f;
  cs.push_back(c);
  c = Opt("softcap");
  c.cap = 5.0f;
  cs.push_back(c);
  c = Opt("weights");
  c.weights = true;
  c.ignore = 0.1;
  cs.push_back(c);
  // Weights of both signs (torch.randn's): mean divides by their sum over the targets,
  // whatever its sign, as torch's cross_entropy does.
  c = Opt("signed_weights");
  c.weights = c.signed_weights = true;
  c.eps = 0.1f;
  c.ignore = 0.1;
  cs.push_back(c);
  c = Opt("bias");
  c.bias = true;
  cs.push_back(c);
  // Liger's use_token_scaling: each row's loss, z-loss and gradient times its p_t.
  c = Opt("token_scaling");
  c.token_scaling = true;
  c.zs = 1e-2f;
  c.ignore = 0.2;
  cs.push_back(c);
  c = Opt("token_scaling_none");
  c.reduction = Reduction::kNone;
  c.token_scaling = c.grad_output = c.bias = true;
  c.eps = 0.1f;
  c.cap = 5.0f;
  c.ignore = 0.2;
  cs.push_back(c);
  c = Opt("grad_f32");
  c.grad_f32 = true;
  cs.push_back(c);
  // Class weights of about 1e-6 (normalised to sum to about 1): the stored gradient's scale
  // goes into the GEMMs, or fp16 keeps a few bits of it.
  c = Opt("tiny_weights_smooth");
  c.eps = 0.1f;
  c.weights = true;
  c.weight_scale = 1e-6;
  cs.push_back(c);
  // The same weights with a z-loss, which does not shrink with them: dividing the weights out
  // of it too would push fp16 past its range.
  c = Opt("sum_tiny_weights_zloss");
  c.reduction = Reduction::kSum;
  c.zs = 5e-2f;
  c.weights = true;
  c.weight_scale = 1e-6;
  cs.push_back(c);
  c = Opt("combined_mean");
  c.eps = 0.1f;
  c.zs = 1e-2f;
  c.cap = 5.0f;
  c.ignore = 0.2;
  c.weights = c.bias = true;
  c.target_dtype = DType::kI32;
  cs.push_back(c);
  c = Opt("combined_none");
  c.reduction = Reduction::kNone;
  c.eps = 0.2f;
  c.zs = 1e-3f;
  c.cap = 8.0f;
  c.ignore = 0.2;
  c.weights = c.bias = c.grad_output = c.grad_f32 = true;
  cs.push_back(c);
  return cs;
}

RandomProblemSpec SpecFor(const Shape& s, DType dtype, const OptionCase& c, uint64_t seed) {
  return SpecOf(s.bt, s.h, s.v, dtype, c, 0.5f, seed);
}

using MatrixParam = std::tuple<Shape, DType, OptionCase>;

class CpuBackendMatrixTest : public ::testing::TestWithParam<MatrixParam> {};

TEST_P(CpuBackendMatrixTest, MatchesReference) {
  const auto& [shape, dtype, c] = GetParam();
  const RandomProblem rp = RandomProblem::Make(
      SpecFor(shape, dtype, c, 1000 + shape.bt * 7 + static_cast<int>(dtype)));
  const LossProblem p = rp.problem();
  ReferenceOutputs ref;
  ASSERT_TRUE(ReferenceCompute(p, &ref).ok());
  HostOutputs got(p, c.grad_f32 ? DType::kF32 : dtype);
  std::unique_ptr<Backend> backend = NewCpuBackend(2);
  LossStats stats;
  absl::Status st = backend->Compute(p, got.outputs(), &stats);
  ASSERT_TRUE(st.ok()) << st;
  const ::testing::AssertionResult match = MatchesReference(p, rp.stats(), ref, got.outputs());
  EXPECT_TRUE(match);
  // The margins of passing cases, for the log.
  if (match) std::cout << match.message() << "\n";
  EXPECT_EQ(stats.chunk_rows, shape.bt);
  EXPECT_EQ(stats.peak_extra_bytes, backend->WorkspaceBytes(ShapeOf(p, got.outputs())));
}

INSTANTIATE_TEST_SUITE_P(
    Matrix, CpuBackendMatrixTest,
    ::testing::Combine(::testing::ValuesIn(kShapes),
                       ::testing::Values(DType::kBF16, DType::kF16, DType::kF32),
                       ::testing::ValuesIn(OptionCases())),
    [](const ::testing::TestParamInfo<MatrixParam>& info) {
      return std::string(std::get<0>(info.param).name) + "_" +
             std::string(DTypeName(std::get<1>(info.param))) + "_" +
             std::get<2>(info.param).name;
    });

// The reference's hand-computed problem: x_0 = e_0, x_1 = e_1 pick columns of W as logits
// z_0 = (0,0,0,0,0), target 2, and z_1 = (1,0,0,0,0), target 0. Every value is exact in
// bf16, so the loss (ln 5 + ln(e + 4) - 1) / 2 holds to fp32 rounding for every dtype.
TEST(CpuBackendTest, HandComputedTinyProblem) {
  const float x[6] = {1, 0, 0, 0, 1, 0};
  const float w[15] = {0, 1, 7, 0, 0, -3, 0, 0, 2, 0, 0, 5, 0, 0, 1};
  const int64_t targets[2] = {2, 0};
  for (DType dtype : {DType::kBF16, DType::kF16, DType::kF32}) {
    std::vector<uint8_t> xs(6 * DTypeSize(dtype)), ws(15 * DTypeSize(dtype));
    for (int k = 0; k < 6; ++k) StoreFromFloat(xs.data(), dtype, k, x[k]);
    for (int k = 0; k < 15; ++k) StoreFromFloat(ws.data(), dtype, k, w[k]);
    LossProblem p;
    p.bt = 2;
    p.h = 3;
    p.v = 5;
    p.dtype = dtype;
    p.x = xs.data();
    p.w = ws.data();
    p.targets = targets;
    HostOutputs got(p, DType::kF32);
    ASSERT_TRUE(NewCpuBackend(1)->Compute(p, got.outputs(), nullptr).ok());
    EXPECT_NEAR(got.loss[0], 1.2571351769942742, 2e-7) << DTypeName(dtype);
    EXPECT_NEAR(got.lse[0], std::log(5.0), 2e-7);
    EXPECT_EQ(got.predictions[0], 0);
    EXPECT_EQ(got.predictions[1], 0);
    EXPECT_EQ(got.accuracy, 0.5f);
    EXPECT_EQ(got.tokens, 2);
    // dX_02 = sum_j (0.2 - [j == 2]) / 2 * W_j2 = 0.5 (0.2 * 12 - 2) = 0.2, with G rounded to
    // the input dtype first (0.1 and -0.4 are inexact in bf16 and fp16).
    const double g_other = dtype == DType::kF32    ? 0.1f
                           : dtype == DType::kBF16 ? Bf16ToFloat(FloatToBf16(0.1f))
                                                   : F16ToFloat(FloatToF16(0.1f));
    const double g_target = dtype == DType::kF32   ? -0.4f
                            : dtype == DType::kBF16 ? Bf16ToFloat(FloatToBf16(-0.4f))
                                                    : F16ToFloat(FloatToF16(-0.4f));
    const double dx02 = g_other * (7 - 3 + 5 + 1) + g_target * 2;
    EXPECT_NEAR(LoadAsFloat(got.dx.data(), DType::kF32, 2), dx02, 1e-6) << DTypeName(dtype);
  }
}

TEST(CpuBackendTest, EveryTargetIgnoredGivesZerosNotNaN) {
  for (DType dtype : {DType::kBF16, DType::kF32}) {
    for (Reduction red : {Reduction::kMean, Reduction::kSum, Reduction::kNone}) {
      RandomProblemSpec spec = ShapeSpec(9, 16, 50, dtype);
      spec.bias = true;
      spec.class_weights = true;
      spec.options.reduction = red;
      spec.options.z_loss_scale = 1e-3f;
      spec.options.label_smoothing = 0.1f;
      spec.ignore_fraction = 1.0;
      const RandomProblem rp = RandomProblem::Make(spec);
      const LossProblem p = rp.problem();
      HostOutputs got(p, dtype);
      ASSERT_TRUE(NewCpuBackend(2)->Compute(p, got.outputs(), nullptr).ok());
      for (float l : got.loss) EXPECT_EQ(l, 0.0f);
      for (float l : got.z_loss) EXPECT_EQ(l, 0.0f);
      EXPECT_EQ(got.tokens, 0);
      EXPECT_EQ(got.accuracy, 0.0f);
      for (int64_t k = 0; k < p.bt * p.h; ++k) EXPECT_EQ(LoadAsFloat(got.dx.data(), dtype, k), 0.0f);
      for (int64_t k = 0; k < p.v * p.h; ++k) EXPECT_EQ(LoadAsFloat(got.dw.data(), dtype, k), 0.0f);
      for (int64_t k = 0; k < p.v; ++k) EXPECT_EQ(LoadAsFloat(got.db.data(), dtype, k), 0.0f);
      for (float l : got.lse) EXPECT_TRUE(std::isfinite(l));
    }
  }
}

TEST(CpuBackendTest, EveryTargetIsTheLastClass) {
  RandomProblemSpec spec = ShapeSpec(33, 24, 77);
  spec.bias = true;
  RandomProblem rp = RandomProblem::Make(spec);
  for (int64_t& t : rp.targets) t = spec.v - 1;
  const LossProblem p = rp.problem();
  ReferenceOutputs ref;
  ASSERT_TRUE(ReferenceCompute(p, &ref).ok());
  HostOutputs got(p, DType::kBF16);
  ASSERT_TRUE(NewCpuBackend(2)->Compute(p, got.outputs(), nullptr).ok());
  EXPECT_TRUE(MatchesReference(p, rp.stats(), ref, got.outputs()));
}

TEST(CpuBackendTest, HugeLogitsDoNotOverflow) {
  for (DType dtype : {DType::kBF16, DType::kF16, DType::kF32}) {
    RandomProblemSpec spec = ShapeSpec(40, 32, 123, dtype);
    // fp16 cannot hold 1e4 * 5 sigma logits (max 65504): scale to stay finite there.
    spec.logit_scale = dtype == DType::kF16 ? 5e3 : 1e4;
    spec.ignore_fraction = 0.1;
    spec.options.z_loss_scale = 1e-4f;
    const RandomProblem rp = RandomProblem::Make(spec);
    const LossProblem p = rp.problem();
    ReferenceOutputs ref;
    ASSERT_TRUE(ReferenceCompute(p, &ref).ok());
    HostOutputs got(p, DType::kF32);
    ASSERT_TRUE(NewCpuBackend(2)->Compute(p, got.outputs(), nullptr).ok());
    EXPECT_GT(rp.stats().abs_max, 1e4);
    EXPECT_TRUE(std::isfinite(got.loss[0])) << DTypeName(dtype);
    for (float l : got.lse) EXPECT_TRUE(std::isfinite(l));
    for (int64_t k = 0; k < p.bt * p.h; ++k) {
      ASSERT_TRUE(std::isfinite(LoadAsFloat(got.dx.data(), DType::kF32, k)));
    }
    for (int64_t k = 0; k < p.v * p.h; ++k) {
      ASSERT_TRUE(std::isfinite(LoadAsFloat(got.dw.data(), DType::kF32, k)));
    }
    EXPECT_TRUE(MatchesReference(p, rp.stats(), ref, got.outputs()));
  }
}

TEST(CpuBackendTest, NaNInputPropagatesWithoutHarm) {
  RandomProblemSpec spec = ShapeSpec(12, 16, 40, DType::kF32);
  RandomProblem rp = RandomProblem::Make(spec);
  reinterpret_cast<float*>(rp.x.data())[3 * spec.h + 5] = std::nanf("");
  const LossProblem p = rp.problem();
  HostOutputs got(p, DType::kF32);
  ASSERT_TRUE(NewCpuBackend(2)->Compute(p, got.outputs(), nullptr).ok());
  EXPECT_TRUE(std::isnan(got.loss[0]));
  for (int64_t i = 0; i < p.bt; ++i) {
    EXPECT_EQ(std::isnan(got.lse[i]), i == 3) << i;
    EXPECT_EQ(std::isnan(LoadAsFloat(got.dx.data(), DType::kF32, i * p.h)), i == 3) << i;
  }
  EXPECT_EQ(got.tokens, p.bt);
}

TEST(CpuBackendTest, SameRequestTwiceIsBitIdenticalAtAnyThreadCount) {
  RandomProblemSpec spec;
  spec.bt = 300;
  spec.h = 64;
  spec.v = 2500;  // three V blocks
  spec.bias = true;
  spec.class_weights = true;
  spec.ignore_fraction = 0.1;
  spec.options.label_smoothing = 0.1f;
  spec.options.z_loss_scale = 1e-3f;
  spec.options.chunk_rows = 128;
  const RandomProblem rp = RandomProblem::Make(spec);
  const LossProblem p = rp.problem();
  HostOutputs first(p, DType::kBF16);
  ASSERT_TRUE(NewCpuBackend(2)->Compute(p, first.outputs(), nullptr).ok());
  for (int threads : {2, 1, 3, 8}) {
    HostOutputs got(p, DType::kBF16);
    ASSERT_TRUE(NewCpuBackend(threads)->Compute(p, got.outputs(), nullptr).ok());
    EXPECT_TRUE(BitIdentical(got, first)) << "threads=" << threads;
  }
}

// max_j sum_k |x_ik w_jk| per row: the scale of the fp32 GEMM rounding of row i's logits.
std::vector<double> MaxAbsDot(const LossProblem& p) {
  std::vector<double> out(p.bt, 0.0);
  for (int64_t i = 0; i < p.bt; ++i) {
    for (int64_t j = 0; j < p.v; ++j) {
      double s = 0;
      for (int64_t k = 0; k < p.h; ++k) {
        s += std::fabs(LoadAsFloat(p.x, p.dtype, i * p.h + k) * LoadAsFloat(p.w, p.dtype, j * p.h + k));
      }
      out[i] = std::max(out[i], s);
    }
  }
  return out;
}

TEST(CpuBackendTest, ConcurrentComputesShareThePoolAndAgree) {
  RandomProblemSpec spec = ShapeSpec(100, 32, 700);
  spec.bias = true;
  spec.options.chunk_rows = 30;
  const RandomProblem rp = RandomProblem::Make(spec);
  const LossProblem p = rp.problem();
  CpuBackend backend(3);
  HostOutputs alone(p, DType::kBF16);
  ASSERT_TRUE(backend.Compute(p, alone.outputs(), nullptr).ok());
  std::vector<std::unique_ptr<HostOutputs>> outs;
  for (int k = 0; k < 4; ++k) outs.push_back(std::make_unique<HostOutputs>(p, DType::kBF16));
  std::vector<std::thread> callers;
  std::vector<absl::Status> status(4);
  for (int k = 0; k < 4; ++k) {
    callers.emplace_back([&, k] { status[k] = backend.Compute(p, outs[k]->outputs(), nullptr); });
  }
  for (std::thread& t : callers) t.join();
  for (int k = 0; k < 4; ++k) {
    EXPECT_TRUE(status[k].ok()) << status[k];
    EXPECT_TRUE(BitIdentical(*outs[k], alone)) << "caller " << k;
  }
}

TEST(CpuBackendTest, ChunkSizeChangesOnlyFp32Rounding) {
  for (DType dtype : {DType::kBF16, DType::kF32}) {
    RandomProblemSpec spec = ShapeSpec(61, 40, 1500, dtype);
    spec.bias = true;
    spec.ignore_fraction = 0.1;
    spec.options.reduction = Reduction::kNone;
    spec.options.z_loss_scale = 1e-3f;
    RandomProblem rp = RandomProblem::Make(spec);
    HostOutputs all(rp.problem(), DType::kF32);
    ASSERT_TRUE(NewCpuBackend(2)->Compute(rp.problem(), all.outputs(), nullptr).ok());
    for (int64_t chunk : {1, 7, 61, 1000}) {
      LossProblem p = rp.problem();
      p.options.chunk_rows = chunk;
      HostOutputs got(p, DType::kF32);
      LossStats stats;
      ASSERT_TRUE(NewCpuBackend(2)->Compute(p, got.outputs(), &stats).ok());
      EXPECT_EQ(stats.chunk_rows, std::min<int64_t>(chunk, spec.bt));
      // The chunk size changes which sgemm kernels OpenBLAS picks (their fp32 rounding), so
      // a logit may move by the GEMM's rounding, |dz| <= h 2^-24 sum_k |x_ik w_jk|, and when
      // that crosses a storage rounding boundary (bf16/fp16) by one storage ulp,
      // <= 2 logit_u |z|. The loss moves by at most (2 + 2 zs |lse|) max_j |dz_j|; lse by
      // max_j |dz_j|.
      const Tolerance tol = ToleranceFor(dtype, DType::kF32);
      const std::vector<double> abs_dot = MaxAbsDot(p);
      std::vector<double> bound(p.bt);
      for (int64_t i = 0; i < p.bt; ++i) {
        const double dz = (dtype == DType::kF32 ? 0.0 : 2 * tol.logit_u * rp.stats().row_abs_max[i]) +
                          p.h * std::ldexp(1.0, -24) * abs_dot[i];
        bound[i] = (2 + 2 * p.options.z_loss_scale * std::fabs(all.lse[i])) * dz;
      }
      for (auto [name, a, b] : {std::make_tuple("loss", &all.loss, &got.loss),
                                std::make_tuple("z_loss", &all.z_loss, &got.z_loss),
                                std::make_tuple("lse", &all.lse, &got.lse)}) {
        CompareResult r = CompareElementwise(name, Widen(a->data(), DType::kF32, p.bt),
                                             Widen(b->data(), DType::kF32, p.bt), bound);
        EXPECT_TRUE(r.ok()) << "chunk " << chunk << " " << DTypeName(dtype) << " " << r.ToString();
      }
      EXPECT_EQ(got.predictions, all.predictions);
      // Gradients: the same terms summed in fp32 by other kernels or in another grouping;
      // independent roundings over a K-term sum grow like sqrt(K) 2^-24 (K = V for dX, the
      // rows for dW and db), with a 4x margin.
      const double grad_tol = 4 * std::sqrt(static_cast<double>(std::max(p.v, p.bt))) *
                               std::ldexp(1.0, -24);
      for (auto [name, n, a, b] :
           {std::make_tuple("dx", p.bt * p.h, all.dx.data(), got.dx.data()),
            std::make_tuple("dw", p.v * p.h, all.dw.data(), got.dw.data()),
            std::make_tuple("db", p.v, all.db.data(), got.db.data())}) {
        CompareResult r = CompareRelNorm(name, Widen(a, DType::kF32, n),
                                         Widen(b, DType::kF32, n), grad_tol);
        EXPECT_TRUE(r.ok()) << "chunk " << chunk << " " << DTypeName(dtype) << " " << r.ToString();
      }
    }
  }
}

// The overlapped path (LossProblem::rows): X released in uneven steps while the Compute runs,
// unreleased rows NaN. Every output must equal the whole-X Compute's byte for byte, every
// WaitX ask for at most BT rows in non-decreasing order ending at BT, and DxReady come in
// strictly increasing rows ending at BT exactly when dX is wanted.
TEST(CpuBackendTest, StreamedRowsGiveTheWholeProblemsBytes) {
  struct Case {
    const char* name;
    bool want_dx, want_grads, accumulate;
  };
  const Case cases[] = {{"all", true, true, false},
                        {"accumulate", true, true, true},
                        {"dw_only", false, true, false},
                        {"loss_only", false, false, false}};
  const std::vector<OptionCase> options = OptionCases();
  std::unique_ptr<Backend> backend = NewCpuBackend(3);
  uint64_t seed = 300;
  for (DType dtype : {DType::kBF16, DType::kF32}) {
    for (const OptionCase& oc : options) {
      const std::string opt_name = oc.name;
      if (opt_name != "combined_mean" && opt_name != "combined_none") continue;
      for (const Case& k : cases) {
        RandomProblemSpec spec = SpecFor(kShapes[2], dtype, oc, ++seed);  // 47 x 31 x 123
        spec.options.chunk_rows = 10;  // 5 chunks, the last of 7 rows
        const RandomProblem rp = RandomProblem::Make(spec);
        const LossProblem whole = rp.problem();
        const DType g = oc.grad_f32 ? DType::kF32 : dtype;
        HostOutputs want(whole, g, k.want_grads, k.accumulate);
        HostOutputs got(whole, g, k.want_grads, k.accumulate);
        LossOutputs want_out = want.outputs(), got_out = got.outputs();
        if (!k.want_dx) want_out.dx = got_out.dx = nullptr;
        ASSERT_TRUE(backend->Compute(whole, want_out, nullptr).ok());

        TrickleRows::Spec ts;
        ts.steps = 4 + static_cast<int>(seed % 4);  // 4 to 7 releases
        ts.seed = seed;
        TrickleRows rows(whole, ts);
        const LossProblem streamed = rows.Streamed(whole);
        const absl::Status st = backend->Compute(streamed, got_out, nullptr);
        const std::string where = std::string(DTypeName(dtype)) + " " + opt_name + " " + k.name;
        ASSERT_TRUE(st.ok()) << where << ": " << st;
        EXPECT_TRUE(BitIdentical(want, got)) << where;

        // One DxReady per chunk (5 here): dX leaves as it is written, not all at the end.
        EXPECT_TRUE(rows.CallsAreValid(whole.bt, k.want_dx ? 5 : 0)) << where;
      }
    }
  }
}

// A WaitX that fails ends the Compute with its status; no row past the released ones is
// reported ready.
TEST(CpuBackendTest, FailedRowWaitEndsTheComputeWithItsStatus) {
  const std::vector<OptionCase> options = OptionCases();
  for (const absl::Status& failure :
       {absl::CancelledError("test: the client went away"),
        absl::DeadlineExceededError("test: rows stalled")}) {
    for (int64_t fail_after : {0, 20, 46}) {
      RandomProblemSpec spec = SpecFor(kShapes[2], DType::kBF16, options[0], 77 + fail_after);
      spec.options.chunk_rows = 10;
      const RandomProblem rp = RandomProblem::Make(spec);
      const LossProblem whole = rp.problem();
      std::unique_ptr<Backend> cpu = NewCpuBackend(2);
      const std::unique_ptr<TrickleRows> rows = ExpectComputeEndsWithTheFailedWait(
          [&](const LossProblem& p, const LossOutputs& out) {
            return cpu->Compute(p, out, nullptr);
          },
          whole, failure, fail_after);
      if (fail_after == 0) {
        // The poison is what makes an early read visible: X never released is all NaN.
        LossProblem unreleased = whole;
        unreleased.x = rows->x();
        HostOutputs nan_out(whole, DType::kBF16);
        ASSERT_TRUE(NewCpuBackend(1)->Compute(unreleased, nan_out.outputs(), nullptr).ok());
        EXPECT_TRUE(std::isnan(nan_out.loss[0]));
      }
    }
  }
}

// No rows: nothing to wait for and no dX to report.
TEST(CpuBackendTest, StreamedEmptyBatch) {
  RandomProblemSpec spec = ShapeSpec(1, 8, 20);
  const RandomProblem rp = RandomProblem::Make(spec);
  LossProblem p = rp.problem();
  p.bt = 0;
  TrickleRows rows(p, TrickleRows::Spec{});
  p = rows.Streamed(p);
  HostOutputs got(p, DType::kBF16);
  ASSERT_TRUE(NewCpuBackend(1)->Compute(p, got.outputs(), nullptr).ok());
  EXPECT_EQ(got.tokens, 0);
  EXPECT_TRUE(rows.dx_ready().empty());
  for (int64_t r : rows.waits()) EXPECT_EQ(r, 0);
}

}  // namespace
}  // namespace lossd
