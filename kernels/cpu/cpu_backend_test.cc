// The CPU backend against the float64 reference: a matrix of shapes x dtypes x options, edge
// cases, determinism, chunk-size invariance, accumulation, and the memory interface.
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
      RandomProblemSpec spec;
      spec.bt = 9;
      spec.h = 16;
      spec.v = 50;
      spec.dtype = dtype;
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
  RandomProblemSpec spec;
  spec.bt = 33;
  spec.h = 24;
  spec.v = 77;
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
    RandomProblemSpec spec;
    spec.bt = 40;
    spec.h = 32;
    spec.v = 123;
    spec.dtype = dtype;
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
  RandomProblemSpec spec;
  spec.bt = 12;
  spec.h = 16;
  spec.v = 40;
  spec.dtype = DType::kF32;
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

// Bytes of every output, for bit-exact comparisons.
std::vector<uint8_t> Bytes(const HostOutputs& o) {
  std::vector<uint8_t> b;
  auto add = [&](const void* d, size_t n) {
    const uint8_t* s = static_cast<const uint8_t*>(d);
    b.insert(b.end(), s, s + n);
  };
  add(o.loss.data(), o.loss.size() * 4);
  add(o.z_loss.data(), o.z_loss.size() * 4);
  add(o.lse.data(), o.lse.size() * 4);
  add(o.predictions.data(), o.predictions.size() * 8);
  add(&o.accuracy, 4);
  add(&o.tokens, 8);
  add(o.dx.data(), o.dx.size());
  add(o.dw.data(), o.dw.size());
  add(o.db.data(), o.db.size());
  add(o.dw_accum.data(), o.dw_accum.size() * 4);
  add(o.db_accum.data(), o.db_accum.size() * 4);
  return b;
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
  std::vector<uint8_t> first;
  for (int threads : {2, 2, 1, 3, 8}) {
    HostOutputs got(p, DType::kBF16);
    ASSERT_TRUE(NewCpuBackend(threads)->Compute(p, got.outputs(), nullptr).ok());
    if (first.empty()) {
      first = Bytes(got);
    } else {
      EXPECT_TRUE(Bytes(got) == first) << "threads=" << threads;
    }
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
  RandomProblemSpec spec;
  spec.bt = 100;
  spec.h = 32;
  spec.v = 700;
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
    EXPECT_TRUE(Bytes(*outs[k]) == Bytes(alone)) << "caller " << k;
  }
}

TEST(CpuBackendTest, ChunkSizeChangesOnlyFp32Rounding) {
  for (DType dtype : {DType::kBF16, DType::kF32}) {
    RandomProblemSpec spec;
    spec.bt = 61;
    spec.h = 40;
    spec.v = 1500;
    spec.dtype = dtype;
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

TEST(CpuBackendTest, AccumulatingMicroBatchesEqualsOneBatch) {
  RandomProblemSpec spec;
  spec.bt = 4 * 37;
  spec.h = 48;
  spec.v = 300;
  spec.bias = true;
  spec.ignore_fraction = 0.1;
  spec.options.reduction = Reduction::kSum;
  spec.options.chunk_rows = 16;
  const RandomProblem rp = RandomProblem::Make(spec);
  const LossProblem big = rp.problem();
  HostOutputs one(big, DType::kF32);
  std::unique_ptr<Backend> backend = NewCpuBackend(2);
  ASSERT_TRUE(backend->Compute(big, one.outputs(), nullptr).ok());

  // The same rows as 4 micro-batches of 37, dW and db added into one accumulator.
  HostOutputs accum(big, DType::kF32, /*want_grads=*/true, /*accumulate=*/true);
  const int64_t micro = spec.bt / 4;
  for (int m = 0; m < 4; ++m) {
    LossProblem p = big;
    p.bt = micro;
    p.x = static_cast<const uint8_t*>(big.x) + m * micro * big.h * DTypeSize(big.dtype);
    p.targets = static_cast<const int64_t*>(big.targets) + m * micro;
    HostOutputs part(p, DType::kF32);
    LossOutputs o = part.outputs();
    o.dw = o.db = nullptr;
    o.dw_accum = accum.dw_accum.data();
    o.db_accum = accum.db_accum.data();
    ASSERT_TRUE(backend->Compute(p, o, nullptr).ok());
  }
  // Different grouping of the fp32 sums over rows only: sqrt(K) 2^-24 growth, 4x margin.
  const double tol = 4 * std::sqrt(static_cast<double>(spec.bt)) * std::ldexp(1.0, -24);
  CompareResult dw = CompareRelNorm("dw", Widen(one.dw.data(), DType::kF32, big.v * big.h),
                                    Widen(accum.dw_accum.data(), DType::kF32, big.v * big.h),
                                    tol);
  EXPECT_TRUE(dw.ok()) << dw.ToString();
  CompareResult db = CompareRelNorm("db", Widen(one.db.data(), DType::kF32, big.v),
                                    Widen(accum.db_accum.data(), DType::kF32, big.v), tol);
  EXPECT_TRUE(db.ok()) << db.ToString();
  // And against the reference of the whole batch.
  ReferenceOutputs ref;
  ASSERT_TRUE(ReferenceCompute(big, &ref).ok());
  LossOutputs o = accum.outputs();
  o.loss = o.z_loss = o.lse = nullptr;
  o.predictions = nullptr;
  o.accuracy = nullptr;
  o.tokens = nullptr;
  o.dx = nullptr;
  EXPECT_TRUE(MatchesReference(big, rp.stats(), ref, o));
}

TEST(CpuBackendTest, AccumulatorAddsToExistingValues) {
  RandomProblemSpec spec;
  spec.bt = 20;
  spec.h = 8;
  spec.v = 30;
  spec.options.reduction = Reduction::kSum;
  const RandomProblem rp = RandomProblem::Make(spec);
  const LossProblem p = rp.problem();
  HostOutputs plain(p, DType::kF32);
  ASSERT_TRUE(NewCpuBackend(1)->Compute(p, plain.outputs(), nullptr).ok());
  std::vector<float> acc(p.v * p.h, 0.5f);
  LossOutputs o;
  o.dw_accum = acc.data();
  ASSERT_TRUE(NewCpuBackend(1)->Compute(p, o, nullptr).ok());
  const float* dw = reinterpret_cast<const float*>(plain.dw.data());
  for (int64_t k = 0; k < p.v * p.h; ++k) EXPECT_EQ(acc[k], 0.5f + dw[k]) << k;
}

// A finite problem whose gradients overflow fp32 (grad_scale 3e38, reduction sum): the stats
// name exactly the outputs that hold a NaN or Inf, whether dW and db are returned or added
// into an accumulator; an ordinary problem reports none.
TEST(CpuBackendTest, OverflowingGradientsAreReported) {
  RandomProblemSpec spec;
  spec.bt = 24;
  spec.h = 16;
  spec.v = 37;
  spec.bias = true;
  spec.options.reduction = Reduction::kSum;
  auto bad = [](const void* d, DType t, int64_t n) {
    for (int64_t k = 0; k < n; ++k) {
      if (!std::isfinite(LoadAsFloat(d, t, k))) return true;
    }
    return false;
  };
  for (DType grad : {DType::kF32, DType::kBF16}) {
    spec.dtype = grad;
    spec.options.grad_scale = 1.0f;
    const RandomProblem ordinary = RandomProblem::Make(spec);
    spec.options.grad_scale = 3e38f;
    const RandomProblem huge = RandomProblem::Make(spec);
    LossStats stats;
    stats.nonfinite = ~0u;  // poisoned: must be overwritten
    HostOutputs fine(ordinary.problem(), grad);
    ASSERT_TRUE(NewCpuBackend(2)->Compute(ordinary.problem(), fine.outputs(), &stats).ok());
    EXPECT_EQ(stats.nonfinite, 0u);

    const LossProblem p = huge.problem();
    HostOutputs got(p, grad);
    ASSERT_TRUE(NewCpuBackend(2)->Compute(p, got.outputs(), &stats).ok());
    ASSERT_TRUE(bad(got.dw.data(), grad, p.v * p.h)) << "the case no longer overflows";
    const uint32_t expect = (bad(got.dx.data(), grad, p.bt * p.h) ? kNonFiniteDx : 0u) |
                            kNonFiniteDw | (bad(got.db.data(), grad, p.v) ? kNonFiniteDb : 0u);
    EXPECT_EQ(stats.nonfinite, expect) << DTypeName(grad);
  }
  // Into an accumulator (finite before): its sum is what the bits describe.
  const RandomProblem huge = RandomProblem::Make(spec);
  const LossProblem p = huge.problem();
  std::vector<float> dw_acc(p.v * p.h, 0.25f), db_acc(p.v, -0.5f);
  LossOutputs o;
  o.grad_dtype = DType::kF32;
  o.dw_accum = dw_acc.data();
  o.db_accum = db_acc.data();
  LossStats stats;
  ASSERT_TRUE(NewCpuBackend(2)->Compute(p, o, &stats).ok());
  EXPECT_EQ(stats.nonfinite,
            kNonFiniteDw | (bad(db_acc.data(), DType::kF32, p.v) ? kNonFiniteDb : 0u));
}

TEST(CpuBackendTest, OnlyTheLossRequested) {
  RandomProblemSpec spec;
  spec.bt = 10;
  spec.h = 8;
  spec.v = 30;
  const RandomProblem rp = RandomProblem::Make(spec);
  const LossProblem p = rp.problem();
  ReferenceOutputs ref;
  ASSERT_TRUE(ReferenceCompute(p, &ref).ok());
  HostOutputs got(p, DType::kBF16, /*want_grads=*/false);
  LossOutputs o = got.outputs();
  EXPECT_EQ(o.dx, nullptr);
  CpuBackend backend(1);
  ASSERT_TRUE(backend.Compute(p, o, nullptr).ok());
  EXPECT_TRUE(MatchesReference(p, rp.stats(), ref, o));
  HostOutputs all(p, DType::kBF16);
  EXPECT_LT(backend.WorkspaceBytes(ShapeOf(p, o)),
            backend.WorkspaceBytes(ShapeOf(p, all.outputs())));
}

TEST(CpuBackendTest, WeightsInBackendMemoryGiveTheSameResult) {
  RandomProblemSpec spec;
  spec.bt = 12;
  spec.h = 16;
  spec.v = 40;
  spec.bias = true;
  const RandomProblem rp = RandomProblem::Make(spec);
  LossProblem p = rp.problem();
  CpuBackend backend(2);
  HostOutputs host(p, DType::kBF16);
  ASSERT_TRUE(backend.Compute(p, host.outputs(), nullptr).ok());
  auto w = backend.Allocate(rp.w.size());
  auto b = backend.Allocate(rp.bias.size());
  ASSERT_TRUE(w.ok() && b.ok());
  ASSERT_TRUE(backend.CopyToBackend(**w, 0, rp.w.data(), rp.w.size()).ok());
  ASSERT_TRUE(backend.CopyToBackend(**b, 0, rp.bias.data(), rp.bias.size()).ok());
  p.w = (*w)->data();
  p.bias = (*b)->data();
  p.w_memory = Memory::kBackend;
  HostOutputs dev(p, DType::kBF16);
  ASSERT_TRUE(backend.Compute(p, dev.outputs(), nullptr).ok());
  EXPECT_TRUE(Bytes(dev) == Bytes(host));
}

TEST(CpuBackendTest, RejectsBadInputWithInvalidArgument) {
  RandomProblemSpec spec;
  spec.bt = 5;
  spec.h = 4;
  spec.v = 6;
  RandomProblem rp = RandomProblem::Make(spec);
  CpuBackend backend(1);
  // The backend assumes a valid problem: a bad one is refused by the validation it is handed
  // through (testing/test_util.h), as the engine hands it every problem.
  {
    HostOutputs got(rp.problem(), DType::kF16);  // bf16 input, fp16 gradients
    absl::Status st = ValidateThenCompute(backend, rp.problem(), got.outputs(), nullptr);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(st.message().find("grad_dtype"), std::string::npos) << st;
  }
  {
    rp.targets[3] = 6;
    HostOutputs got(rp.problem(), DType::kBF16);
    absl::Status st = ValidateThenCompute(backend, rp.problem(), got.outputs(), nullptr);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(st.message().find("targets[3] = 6"), std::string::npos) << st;
    rp.targets[3] = 0;
  }
  {
    LossProblem p = rp.problem();
    p.options.label_smoothing = 1.5f;
    HostOutputs got(p, DType::kBF16);
    absl::Status st = ValidateThenCompute(backend, p, got.outputs(), nullptr);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(st.message().find("label_smoothing"), std::string::npos) << st;
  }
  {
    LossProblem p = rp.problem();
    p.h = 0;
    HostOutputs got(rp.problem(), DType::kBF16);
    absl::Status st = ValidateThenCompute(backend, p, got.outputs(), nullptr);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(st.message().find("h=0"), std::string::npos) << st;
  }
}

TEST(CpuBackendTest, MemoryInterface) {
  CpuBackend backend(1);
  const BackendInfo before = backend.Info();
  EXPECT_EQ(before.name, "cpu");
  EXPECT_FALSE(before.device.empty());
  EXPECT_GT(before.memory_total_bytes, 0u);
  EXPECT_TRUE(before.healthy);
  EXPECT_EQ(before.memory_budget_bytes, 0u);  // no limit of its own
  auto buf = backend.Allocate(100);
  ASSERT_TRUE(buf.ok()) << buf.status();
  EXPECT_EQ((*buf)->size(), 100u);
  EXPECT_GE(backend.Info().memory_peak_bytes, 100u);
  EXPECT_GE(backend.Info().memory_held_bytes, before.memory_held_bytes + 100);
  std::vector<uint8_t> src(60), dst(60, 0xFF);
  for (int k = 0; k < 60; ++k) src[k] = static_cast<uint8_t>(k + 1);
  ASSERT_TRUE(backend.CopyToBackend(**buf, 40, src.data(), 60).ok());
  ASSERT_TRUE(backend.CopyFromBackend(**buf, 40, dst.data(), 60).ok());
  EXPECT_EQ(src, dst);
  absl::Status st = backend.CopyToBackend(**buf, 41, src.data(), 60);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("offset 41"), std::string::npos) << st;
  EXPECT_EQ(backend.CopyFromBackend(**buf, 101, dst.data(), 0).code(),
            absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(backend.Zero(**buf).ok());
  ASSERT_TRUE(backend.CopyFromBackend(**buf, 0, dst.data(), 60).ok());
  EXPECT_EQ(dst, std::vector<uint8_t>(60, 0));
  // A buffer may outlive its backend.
  auto backend2 = NewCpuBackend(2);
  auto late = backend2->Allocate(10);
  ASSERT_TRUE(late.ok());
  backend2.reset();
  late->reset();
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
        TrickleRows rows(whole.x, whole.bt, whole.h * DTypeSize(dtype), ts);
        LossProblem streamed = whole;
        streamed.x = rows.x();
        streamed.rows = &rows;
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
  RandomProblemSpec spec;
  spec.bt = 1;
  spec.h = 8;
  spec.v = 20;
  const RandomProblem rp = RandomProblem::Make(spec);
  LossProblem p = rp.problem();
  p.bt = 0;
  TrickleRows rows(p.x, 0, p.h * DTypeSize(p.dtype), TrickleRows::Spec{});
  p.x = rows.x();
  p.rows = &rows;
  HostOutputs got(p, DType::kBF16);
  ASSERT_TRUE(NewCpuBackend(1)->Compute(p, got.outputs(), nullptr).ok());
  EXPECT_EQ(got.tokens, 0);
  EXPECT_TRUE(rows.dx_ready().empty());
  for (int64_t r : rows.waits()) EXPECT_EQ(r, 0);
}

TEST(CpuBackendTest, DefaultChunkKeepsTheChunkBufferBounded) {
  LossProblem p;
  p.bt = 1 << 20;
  p.h = 4096;
  p.v = 128256;
  const int64_t c = CpuBackend::ChunkRows(p);
  EXPECT_GE(c, 1);
  EXPECT_LE(static_cast<uint64_t>(c) * p.v * 4, CpuBackend::kDefaultChunkBytes);
  p.options.chunk_rows = 7;
  EXPECT_EQ(CpuBackend::ChunkRows(p), 7);
  p.bt = 3;
  EXPECT_EQ(CpuBackend::ChunkRows(p), 3);
}

}  // namespace
}  // namespace lossd
