// GPU tests of the CUDA backend against the float64 reference: every option and dtype over
// tiny, odd, medium and realistic shapes, outputs poisoned before each run; determinism;
// weights and accumulators already on the device; out-of-memory and bad input.
#include "kernels/cuda/cuda_backend.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/reference.h"
#include "testing/test_util.h"
#include "kernels/cuda/fused_loss.h"
#include "core/dtype.h"
#include "core/loss_problem.h"

namespace lossd {
namespace cuda {
namespace {

bool HaveGpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

// One backend per test binary: creating a cuBLASLt handle and streams per test is slow.
CudaBackend* SharedBackend() {
  static CudaBackend* backend = [] {
    absl::StatusOr<std::unique_ptr<CudaBackend>> b = CudaBackend::Create(CudaBackendOptions{});
    return b.ok() ? b->release() : nullptr;
  }();
  return backend;
}

class CudaTest : public testing::Test {
 protected:
  void SetUp() override {
    if (!HaveGpu()) GTEST_SKIP() << "no GPU";
    backend_ = SharedBackend();
    ASSERT_NE(backend_, nullptr);
  }
  CudaBackend* backend_ = nullptr;
};

struct Shape {
  const char* name;
  int64_t bt, h, v;
};

const Shape kShapes[] = {
    {"tiny", 4, 8, 16},
    {"odd", 47, 31, 123},
    {"medium", 300, 96, 1000},
};

const OptionCase kOptions[] = {
    {"mean"},
    {"sum_smooth_weights", Reduction::kSum, 0.1f, 0, 0, false, true},
    {"none_gradout_zloss_softcap", Reduction::kNone, 0, 1e-3f, 5.0f, false, false, true},
    {"mean_all", Reduction::kMean, 0.1f, 1e-4f, 4.0f, true, true, false, 0.3, 0,
     DType::kI32},
    {"chunked_bias_ignore", Reduction::kMean, 0, 0, 0, true, false, false, 0.2, 7},
    {"grad_f32", Reduction::kSum, 0.05f, 0, 0, true, false, false, 0.1, 0, DType::kI64,
     true},
    {"accumulate", Reduction::kMean, 0, 1e-4f, 0, true, true, false, 0.1, 16, DType::kI64,
     false, true},
    // Class weights of about 1e-6 (normalised to sum to about 1 over a large vocabulary): the
    // stored fp16 gradient cw_t (p - [j == t]) underflowed until the weights' scale went into
    // the GEMMs' alpha.
    {"mean_tiny_weights_smooth", Reduction::kMean, 0.1f, 0, 0, false, true, false, 0.1, 0,
     DType::kI64, false, false, 1e-6},
    // The same weights with a z-loss, which does not shrink with them: dividing the weights
    // out of that part of G too would push fp16 past its range.
    {"sum_tiny_weights_zloss", Reduction::kSum, 0, 5e-2f, 0, false, true, false, 0.1, 0,
     DType::kI64, false, false, 1e-6},
    // Weights of both signs (torch.randn's): mean divides by their sum, whatever its sign.
    {"mean_signed_weights_smooth", Reduction::kMean, 0.1f, 1e-4f, 0, true, true, false, 0.1, 0,
     DType::kI64, false, false, 1, true},
    // Liger's use_token_scaling: each row's loss, z-loss and gradient times its p_t.
    {"mean_token_scaling_all", Reduction::kMean, 0.1f, 1e-3f, 5.0f, true, true, false, 0.2, 0,
     DType::kI64, false, false, 1, false, true},
    {"none_token_scaling_gradout_chunked", Reduction::kNone, 0, 1e-3f, 0, true, false, true,
     0.2, 7, DType::kI64, true, false, 1, false, true},
};
constexpr int kNumOptions = static_cast<int>(sizeof(kOptions) / sizeof(kOptions[0]));

// grad_scale 1 for reduction none (the per-row losses scale by grad_output), 0.7 otherwise.
RandomProblemSpec MakeSpec(const Shape& s, const OptionCase& o, DType dtype, uint64_t seed) {
  return SpecOf(s.bt, s.h, s.v, dtype, o, o.reduction == Reduction::kNone ? 1.0f : 0.7f, seed);
}

using MatrixParam = std::tuple<int, int, DType>;

class CudaMatrixTest : public CudaTest, public testing::WithParamInterface<MatrixParam> {};

TEST_P(CudaMatrixTest, MatchesReference) {
  const Shape& shape = kShapes[std::get<0>(GetParam())];
  const OptionCase& opt = kOptions[std::get<1>(GetParam())];
  const DType dtype = std::get<2>(GetParam());
  if (opt.token_scaling && dtype == DType::kF16 && shape.v >= 1000) {
    // A known limit, documented with the option (README, lossd.proto): G, stored in fp16 over
    // the logits, times s = p_t ~ 1/V falls below fp16's normal range, and dX's error
    // outgrows the relative model of MatchesReference (measured 0.96% against 0.80% here).
    GTEST_SKIP() << "fp16 with token_scaling: the scaled gradient underflows fp16 (README)";
  }
  RandomProblem rp = RandomProblem::Make(MakeSpec(shape, opt, dtype, 17 + shape.v));
  const LossProblem p = rp.problem();
  ReferenceOutputs ref;
  ASSERT_TRUE(ReferenceCompute(p, &ref).ok());
  const DType grad_dtype = opt.grad_f32 ? DType::kF32 : dtype;
  HostOutputs out(p, grad_dtype, /*want_grads=*/true, opt.accumulate);
  LossStats stats;
  const absl::Status st = backend_->Compute(p, out.outputs(), &stats);
  ASSERT_TRUE(st.ok()) << st;
  EXPECT_GT(stats.chunk_rows, 0);
  if (opt.chunk_rows > 0) {
    EXPECT_EQ(stats.chunk_rows, std::min(opt.chunk_rows, shape.bt));
  }
  EXPECT_TRUE(MatchesReference(p, rp.stats(), ref, out.outputs()));
}

std::string MatrixName(const testing::TestParamInfo<MatrixParam>& info) {
  return std::string(kShapes[std::get<0>(info.param)].name) + "_" +
         kOptions[std::get<1>(info.param)].name + "_" +
         std::string(DTypeName(std::get<2>(info.param)));
}

INSTANTIATE_TEST_SUITE_P(AllOptions, CudaMatrixTest,
                         testing::Combine(testing::Range(0, 3), testing::Range(0, kNumOptions),
                                          testing::Values(DType::kBF16, DType::kF16,
                                                          DType::kF32)),
                         MatrixName);

// Realistic widths (GPU only: the reference takes seconds here). Several chunks, with the
// two-half overlap inside each.
TEST_F(CudaTest, RealisticShapeMatchesReference) {
  for (DType dtype : {DType::kBF16, DType::kF32}) {
    OptionCase o{"realistic", Reduction::kMean, 0.1f, 1e-4f, 0, true, false, false, 0.05,
                512};
    RandomProblem rp = RandomProblem::Make(MakeSpec({"real", 600, 256, 32000}, o, dtype, 5));
    const LossProblem p = rp.problem();
    ReferenceOutputs ref;
    ASSERT_TRUE(ReferenceCompute(p, &ref).ok());
    HostOutputs out(p, dtype);
    LossStats stats;
    ASSERT_TRUE(backend_->Compute(p, out.outputs(), &stats).ok());
    EXPECT_EQ(stats.chunk_rows, 512);
    EXPECT_TRUE(MatchesReference(p, rp.stats(), ref, out.outputs())) << DTypeName(dtype);
  }
}

// Outputs of two identical requests, byte for byte.
TEST_F(CudaTest, SameRequestTwiceIsBitIdentical) {
  OptionCase o{"det", Reduction::kMean, 0.1f, 1e-4f, 10.0f, true, true, false, 0.1, 0};
  RandomProblem rp = RandomProblem::Make(MakeSpec({"d", 1500, 192, 4000}, o, DType::kBF16, 9));
  const LossProblem p = rp.problem();
  HostOutputs a(p, DType::kBF16), b(p, DType::kBF16);
  ASSERT_TRUE(backend_->Compute(p, a.outputs(), nullptr).ok());
  ASSERT_TRUE(backend_->Compute(p, b.outputs(), nullptr).ok());
  EXPECT_TRUE(BitIdentical(a, b));  // every output, the scalars too
}

// Chunk size changes the result only at fp32 rounding (the design's promise): cuBLAS may pick
// another algorithm, and so another fp32 summation order, for a GEMM of another width.
TEST_F(CudaTest, ChunkSizeChangesTheLossOnlyAtFp32Rounding) {
  OptionCase o{"chunks", Reduction::kSum, 0, 0, 0, false, false, false, 0, 0};
  RandomProblem rp = RandomProblem::Make(MakeSpec({"c", 200, 64, 500}, o, DType::kF32, 3));
  LossProblem p = rp.problem();
  HostOutputs a(p, DType::kF32), b(p, DType::kF32);
  p.options.chunk_rows = 200;
  ASSERT_TRUE(backend_->Compute(p, a.outputs(), nullptr).ok());
  p.options.chunk_rows = 33;
  ASSERT_TRUE(backend_->Compute(p, b.outputs(), nullptr).ok());
  std::vector<double> la(a.lse.begin(), a.lse.end()), lb(b.lse.begin(), b.lse.end());
  // A few fp32 ulps of the row's lse (H = 64 products per logit, V = 500 terms per lse).
  std::vector<double> bound(la.size());
  for (size_t i = 0; i < la.size(); ++i) bound[i] = 1e-6 * (std::abs(la[i]) + 1);
  CompareResult r = CompareElementwise("lse chunk 200 vs 33", la, lb, bound);
  EXPECT_TRUE(r.ok()) << r.ToString();
  EXPECT_NEAR(a.loss[0], b.loss[0], 1e-6 * std::abs(a.loss[0]));
  r = CompareRelNorm("dx chunk 200 vs 33", Widen(a.dx.data(), DType::kF32, p.bt * p.h),
                     Widen(b.dx.data(), DType::kF32, p.bt * p.h), 1e-6);
  EXPECT_TRUE(r.ok()) << r.ToString();
  // dW is where the chunks' order of summation shows: still fp32 rounding only.
  r = CompareRelNorm("dw chunk 200 vs 33", Widen(a.dw.data(), DType::kF32, p.v * p.h),
                     Widen(b.dw.data(), DType::kF32, p.v * p.h), 1e-6);
  EXPECT_TRUE(r.ok()) << r.ToString();
}

// Both schedules over several chunks, with every gradient and the accumulators.
TEST_F(CudaTest, BothSchedulesMatchReference) {
  const std::pair<Schedule, int32_t> configs[] = {
      {Schedule::kRowHalves, 0}, {Schedule::kColumnHalves, 0}, {Schedule::kColumnHalves, 56}};
  for (const auto& [schedule, side_sms] : configs) {
    CudaBackendOptions bo;
    bo.schedule = schedule;
    bo.auto_schedule = false;
    bo.side_sms = side_sms;
    auto b = CudaBackend::Create(bo);
    ASSERT_TRUE(b.ok()) << b.status();
    for (int oi : {0, 3, 4, 6}) {
      OptionCase o = kOptions[oi];
      o.chunk_rows = 512;  // row halves take effect from 512 rows
      for (DType dtype : {DType::kBF16, DType::kF32}) {
        RandomProblem rp =
            RandomProblem::Make(MakeSpec({"sched", 1200, 48, 1000}, o, dtype, 31 + oi));
        const LossProblem p = rp.problem();
        ReferenceOutputs ref;
        ASSERT_TRUE(ReferenceCompute(p, &ref).ok());
        HostOutputs out(p, dtype, /*want_grads=*/true, o.accumulate);
        ASSERT_TRUE((*b)->Compute(p, out.outputs(), nullptr).ok());
        EXPECT_TRUE(MatchesReference(p, rp.stats(), ref, out.outputs()))
            << "schedule " << static_cast<int>(schedule) << " side_sms " << side_sms << " "
            << o.name << " "
            << DTypeName(dtype);
      }
    }
  }
}

// Weights, bias and the accumulators already on the device (the server's cached weights and
// per-step accumulators), two micro-batches added into the same accumulator.
TEST_F(CudaTest, DeviceWeightsAndAccumulators) {
  OptionCase o{"dev", Reduction::kMean, 0.05f, 0, 0, true, false, false, 0.1, 0};
  RandomProblem rp = RandomProblem::Make(MakeSpec({"dev", 64, 256, 2048}, o, DType::kBF16, 21));
  LossProblem p = rp.problem();
  ReferenceOutputs ref;
  ASSERT_TRUE(ReferenceCompute(p, &ref).ok());
  auto w = backend_->Allocate(rp.w.size());
  auto bias = backend_->Allocate(rp.bias.size());
  auto dw = backend_->Allocate(p.v * p.h * 4);
  auto db = backend_->Allocate(p.v * 4);
  ASSERT_TRUE(w.ok() && bias.ok() && dw.ok() && db.ok());
  ASSERT_TRUE(backend_->CopyToBackend(**w, 0, rp.w.data(), rp.w.size()).ok());
  ASSERT_TRUE(backend_->CopyToBackend(**bias, 0, rp.bias.data(), rp.bias.size()).ok());
  ASSERT_TRUE(backend_->Zero(**dw).ok());
  ASSERT_TRUE(backend_->Zero(**db).ok());
  LossProblem pd = p;
  pd.w = (*w)->data();
  pd.bias = (*bias)->data();
  pd.w_memory = Memory::kBackend;
  HostOutputs out(p, DType::kBF16, /*want_grads=*/true, /*accumulate=*/true);
  LossOutputs lo = out.outputs();
  lo.dw_accum = static_cast<float*>((*dw)->data());
  lo.db_accum = static_cast<float*>((*db)->data());
  lo.accum_memory = Memory::kBackend;
  for (int step = 0; step < 2; ++step) {
    out.Poison();
    ASSERT_TRUE(backend_->Compute(pd, lo, nullptr).ok());
    EXPECT_TRUE(MatchesReference(p, rp.stats(), ref, [&] {
      LossOutputs only = out.outputs();
      only.dw_accum = nullptr;
      only.db_accum = nullptr;
      return only;
    }()));
  }
  // The accumulators hold twice the reference gradient.
  std::vector<float> dw_host(p.v * p.h), db_host(p.v);
  ASSERT_TRUE(backend_->CopyFromBackend(**dw, 0, dw_host.data(), dw_host.size() * 4).ok());
  ASSERT_TRUE(backend_->CopyFromBackend(**db, 0, db_host.data(), db_host.size() * 4).ok());
  std::vector<double> ref2(ref.dw.size()), got(dw_host.begin(), dw_host.end());
  for (size_t k = 0; k < ref.dw.size(); ++k) ref2[k] = 2 * ref.dw[k];
  const Tolerance tol = ToleranceFor(DType::kBF16, DType::kF32);
  const double bound = 2 * tol.logit_u * rp.stats().rms_row_abs_max + tol.logit_u + tol.grad_u +
                       tol.fp32_rel;
  CompareResult r = CompareRelNorm("dw_accum x2", ref2, got, bound);
  EXPECT_TRUE(r.ok()) << r.ToString();
  std::vector<double> dbr(ref.db.size()), dbg(db_host.begin(), db_host.end());
  for (size_t k = 0; k < ref.db.size(); ++k) dbr[k] = 2 * ref.db[k];
  r = CompareRelNorm("db_accum x2", dbr, dbg, bound);
  EXPECT_TRUE(r.ok()) << r.ToString();
}

// A finite problem whose gradients overflow fp32 (grad_scale 3e38, reduction sum): the stats
// name exactly the outputs holding a NaN or Inf, as a scan of the returned bytes finds them,
// for returned gradients and for a device accumulator; an ordinary problem reports none.
TEST_F(CudaTest, OverflowingGradientsAreReported) {
  auto bad = [](const void* d, DType t, int64_t n) {
    for (int64_t k = 0; k < n; ++k) {
      if (!std::isfinite(LoadAsFloat(d, t, k))) return true;
    }
    return false;
  };
  for (DType dtype : {DType::kBF16, DType::kF16, DType::kF32}) {
    RandomProblemSpec spec;
    spec.bt = 48;
    spec.h = 64;
    spec.v = 301;
    spec.dtype = dtype;
    spec.bias = true;
    spec.options.reduction = Reduction::kSum;
    const RandomProblem ordinary = RandomProblem::Make(spec);
    spec.options.grad_scale = 3e38f;
    const RandomProblem huge = RandomProblem::Make(spec);
    LossStats stats;
    stats.nonfinite = ~0u;  // must be overwritten
    HostOutputs fine(ordinary.problem(), dtype);
    ASSERT_TRUE(backend_->Compute(ordinary.problem(), fine.outputs(), &stats).ok());
    EXPECT_EQ(stats.nonfinite, 0u) << DTypeName(dtype);

    const LossProblem p = huge.problem();
    HostOutputs got(p, dtype);
    ASSERT_TRUE(backend_->Compute(p, got.outputs(), &stats).ok());
    ASSERT_TRUE(bad(got.dw.data(), dtype, p.v * p.h)) << "the case no longer overflows";
    const uint32_t expect = (bad(got.dx.data(), dtype, p.bt * p.h) ? kNonFiniteDx : 0u) |
                            kNonFiniteDw | (bad(got.db.data(), dtype, p.v) ? kNonFiniteDb : 0u);
    EXPECT_EQ(stats.nonfinite, expect) << DTypeName(dtype);

    // Into a device accumulator, finite before: the bits describe its sum.
    auto dw = backend_->Allocate(p.v * p.h * 4);
    auto db = backend_->Allocate(p.v * 4);
    ASSERT_TRUE(dw.ok() && db.ok());
    ASSERT_TRUE(backend_->Zero(**dw).ok());
    ASSERT_TRUE(backend_->Zero(**db).ok());
    LossOutputs lo;
    lo.grad_dtype = dtype;
    lo.dw_accum = static_cast<float*>((*dw)->data());
    lo.db_accum = static_cast<float*>((*db)->data());
    lo.accum_memory = Memory::kBackend;
    ASSERT_TRUE(backend_->Compute(ordinary.problem(), lo, &stats).ok());
    EXPECT_EQ(stats.nonfinite, 0u) << DTypeName(dtype);
    ASSERT_TRUE(backend_->Compute(p, lo, &stats).ok());
    std::vector<float> db_host(p.v);
    ASSERT_TRUE(backend_->CopyFromBackend(**db, 0, db_host.data(), p.v * 4).ok());
    EXPECT_EQ(stats.nonfinite,
              kNonFiniteDw | (bad(db_host.data(), DType::kF32, p.v) ? kNonFiniteDb : 0u))
        << DTypeName(dtype);
  }
}

// The whole-batch layout (a fresh dW lends its memory to the logits, fused_loss.h): the
// option sets it applies to (a fresh dW, no chunk_rows) in each dtype, over about four
// vocabulary blocks, with one and with two row halves and V % 8 != 0. The plan is asserted,
// so a fallback to row chunks cannot pass unseen; the same request twice is bit-identical.
TEST_F(CudaTest, WholeBatchLayoutMatchesReference) {
  struct WholeShape {
    int64_t bt, h, v;
    DType dtype;
  };
  const WholeShape shapes[] = {{200, 128, 3000, DType::kBF16},
                               {600, 320, 2999, DType::kBF16},
                               {100, 128, 3001, DType::kF32},
                               {120, 64, 1000, DType::kF16}};
  for (const WholeShape& ws : shapes) {
    const uint64_t elem = DTypeSize(ws.dtype);
    const uint64_t cols = ((ws.v / 4) + 63) / 64 * 64;
    CudaBackendOptions bo;
    bo.whole_batch = true;
    bo.chunk_budget_bytes = 2 * kGemmWorkspaceBytes + 256 +
                            (static_cast<uint64_t>(ws.bt) * ws.h * 4 + 255) / 256 * 256 +
                            static_cast<uint64_t>(ws.bt) * elem * cols;
    auto b = CudaBackend::Create(bo);
    ASSERT_TRUE(b.ok()) << b.status();
    for (int oi : {0, 1, 2, 3, 5}) {
      const OptionCase& o = kOptions[oi];
      RandomProblem rp = RandomProblem::Make(
          MakeSpec({"whole", ws.bt, ws.h, ws.v}, o, ws.dtype, 51 + oi + ws.v));
      const LossProblem p = rp.problem();
      ReferenceOutputs ref;
      ASSERT_TRUE(ReferenceCompute(p, &ref).ok());
      const DType grad_dtype = o.grad_f32 ? DType::kF32 : ws.dtype;
      HostOutputs out(p, grad_dtype), again(p, grad_dtype);
      const ChunkPlan plan = (*b)->Plan(p, out.outputs());
      EXPECT_GE(plan.blocks, 3) << o.name << " " << DTypeName(ws.dtype) << " bt " << ws.bt;
      EXPECT_EQ(plan.chunk_rows, ws.bt);
      ASSERT_TRUE((*b)->Compute(p, out.outputs(), nullptr).ok());
      EXPECT_TRUE(MatchesReference(p, rp.stats(), ref, out.outputs()))
          << o.name << " " << DTypeName(ws.dtype) << " bt " << ws.bt << " v " << ws.v;
      ASSERT_TRUE((*b)->Compute(p, again.outputs(), nullptr).ok());
      EXPECT_TRUE(BitIdentical(out, again)) << o.name;
    }
  }
}

// The first Compute of a shape times cuBLASLt's candidates on the real buffers before any
// real work. Into an accumulator that already holds a sum, that must add exactly one
// micro-batch: the accumulator starts at the reference dW and must end at twice it, for
// both schedules, with autotuning on (a fresh backend, so this shape is new) and off.
TEST_F(CudaTest, AutotuningOnFirstUseLeavesAnAccumulatorAsItWas) {
  OptionCase o{"tune", Reduction::kMean, 0.05f, 0, 0, false, false, false, 0.1, 256};
  RandomProblem rp = RandomProblem::Make(MakeSpec({"tune", 1000, 64, 1500}, o, DType::kBF16, 41));
  const LossProblem p = rp.problem();
  ReferenceOutputs ref;
  ASSERT_TRUE(ReferenceCompute(p, &ref).ok());
  const std::vector<float> start(ref.dw.begin(), ref.dw.end());
  for (Schedule schedule : {Schedule::kRowHalves, Schedule::kColumnHalves}) {
    for (bool autotune : {true, false}) {
      CudaBackendOptions bo;
      bo.schedule = schedule;
      bo.auto_schedule = false;
      bo.autotune_gemms = autotune;
      auto b = CudaBackend::Create(bo);
      ASSERT_TRUE(b.ok()) << b.status();
      auto dw = (*b)->Allocate(p.v * p.h * 4);
      ASSERT_TRUE(dw.ok());
      ASSERT_TRUE((*b)->CopyToBackend(**dw, 0, start.data(), start.size() * 4).ok());
      HostOutputs out(p, DType::kBF16, /*want_grads=*/true, /*accumulate=*/true);
      LossOutputs lo = out.outputs();
      lo.dw_accum = static_cast<float*>((*dw)->data());
      lo.db_accum = nullptr;
      lo.accum_memory = Memory::kBackend;
      ASSERT_TRUE((*b)->Compute(p, lo, nullptr).ok());
      std::vector<float> dw_host(p.v * p.h);
      ASSERT_TRUE((*b)->CopyFromBackend(**dw, 0, dw_host.data(), dw_host.size() * 4).ok());
      // What was added, against one micro-batch's reference: compared with the whole sum
      // (twice the reference) the added error would count against twice its norm.
      std::vector<double> added(dw_host.size());
      for (size_t k = 0; k < added.size(); ++k) {
        added[k] = static_cast<double>(dw_host[k]) - static_cast<double>(start[k]);
      }
      const Tolerance tol = ToleranceFor(DType::kBF16, DType::kF32);
      const double bound = 2 * tol.logit_u * rp.stats().rms_row_abs_max + tol.logit_u +
                           tol.grad_u + tol.fp32_rel;
      CompareResult r = CompareRelNorm("dw_accum - start (one micro-batch)", ref.dw, added, bound);
      EXPECT_TRUE(r.ok()) << r.ToString() << " schedule " << static_cast<int>(schedule)
                          << " autotune " << autotune;
    }
  }
}

// A BT that moves from call to call (unpadded batches) makes new chunk GEMM shapes each time.
// Autotuning times each tuning class once: a BT whose GEMMs fall in the classes already timed
// (within 12.5%) costs no tuning and still matches the reference, twice bit-identically; a BT
// far from them is timed.
TEST_F(CudaTest, AMovingBtTimesEachTuningClassOnce) {
  CudaBackendOptions bo;
  bo.autotune_gemms = true;
  auto b = CudaBackend::Create(bo);  // fresh: nothing timed yet
  ASSERT_TRUE(b.ok()) << b.status();
  OptionCase o{"moving", Reduction::kMean, 0.05f, 0, 0, false, false, false, 0.1, 0};
  struct Step {
    int64_t bt;
    bool tunes;
  };
  // 1000 and 1010 rows: row halves of 512 + 488 and 512 + 498, dX and dW over 1000 and 1010
  // rows, all in the classes 512 and 1024. 300 rows: one piece, class 320.
  const Step steps[] = {{1000, true}, {1000, false}, {1010, false}, {300, true}, {1010, false}};
  uint64_t seed = 70;
  for (const Step& st : steps) {
    RandomProblem rp =
        RandomProblem::Make(MakeSpec({"moving", st.bt, 64, 1500}, o, DType::kBF16, ++seed));
    const LossProblem p = rp.problem();
    ReferenceOutputs ref;
    ASSERT_TRUE(ReferenceCompute(p, &ref).ok());
    HostOutputs first(p, DType::kBF16), again(p, DType::kBF16);
    LossStats stats;
    ASSERT_TRUE((*b)->Compute(p, first.outputs(), &stats).ok()) << "bt " << st.bt;
    if (st.tunes) {
      EXPECT_GT(stats.gemm_tunings, 0) << "bt " << st.bt;
    } else {
      EXPECT_EQ(stats.gemm_tunings, 0) << "bt " << st.bt;
    }
    EXPECT_TRUE(MatchesReference(p, rp.stats(), ref, first.outputs())) << "bt " << st.bt;
    ASSERT_TRUE((*b)->Compute(p, again.outputs(), &stats).ok()) << "bt " << st.bt;
    EXPECT_EQ(stats.gemm_tunings, 0) << "bt " << st.bt << " again";
    EXPECT_TRUE(BitIdentical(first, again)) << "bt " << st.bt;
  }
}

// Reduction none with small upstream gradients (1e-5, as from a mean over many tokens done
// by the caller) with fp16 inputs and fp32 gradients out: stored as rs (p - onehot), most
// gradient elements would be fp16 subnormals or zero (below 6.1e-5), and dX would lose the
// softmax-weighted part of W; the largest |rs| leaves the stored gradient as a power of two,
// so the results keep fp16 accuracy. (fp16 gradients out would be subnormal themselves.)
TEST_F(CudaTest, SmallUpstreamGradientsDoNotUnderflowFp16) {
  OptionCase o{"tiny_rs", Reduction::kNone, 0, 0, 0, true, false, true, 0.1, 0};
  for (DType dtype : {DType::kF16, DType::kBF16}) {
    RandomProblem rp = RandomProblem::Make(MakeSpec({"rs", 300, 128, 2000}, o, dtype, 61));
    for (float& g : rp.grad_output) g *= 1e-5f;
    const LossProblem p = rp.problem();
    ReferenceOutputs ref;
    ASSERT_TRUE(ReferenceCompute(p, &ref).ok());
    HostOutputs out(p, DType::kF32);
    ASSERT_TRUE(backend_->Compute(p, out.outputs(), nullptr).ok());
    EXPECT_TRUE(MatchesReference(p, rp.stats(), ref, out.outputs())) << DTypeName(dtype);
  }
}

// The schedule follows the chunk length: column halves for short chunks (several of them,
// with a dW to accumulate), row halves otherwise.
TEST_F(CudaTest, ScheduleFollowsTheChunkLength) {
  LossProblem p;
  p.dtype = DType::kBF16;
  LossOutputs with_dw, dx_only;
  float marker = 0;
  with_dw.dw = &marker;  // never dereferenced: Plan reads only which outputs are wanted
  with_dw.dx = &marker;
  dx_only.dx = &marker;
  // The default budget's 2 GiB ceiling holds fewer than 2048 rows of a 2^20 vocabulary.
  p.bt = 8192, p.h = 2304, p.v = 1 << 20;
  EXPECT_LT(backend_->Plan(p, with_dw).chunk_rows, 2048);
  EXPECT_EQ(backend_->Plan(p, with_dw).schedule, Schedule::kColumnHalves);
  EXPECT_EQ(backend_->Plan(p, dx_only).schedule, Schedule::kRowHalves);
  p.bt = 8192, p.h = 2304, p.v = 256000;  // the default budget grows to 2048 rows
  EXPECT_EQ(backend_->Plan(p, with_dw).chunk_rows, 2048);
  EXPECT_EQ(backend_->Plan(p, with_dw).schedule, Schedule::kRowHalves);
  p.bt = 8192, p.h = 4096, p.v = 128256;  // 2048 rows
  EXPECT_EQ(backend_->Plan(p, with_dw).chunk_rows, 2048);
  EXPECT_EQ(backend_->Plan(p, with_dw).schedule, Schedule::kRowHalves);
  p.bt = 1000, p.h = 64, p.v = 1000;  // one chunk: nothing to overlap across chunks
  EXPECT_EQ(backend_->Plan(p, with_dw).schedule, Schedule::kRowHalves);
}

TEST_F(CudaTest, EveryTargetIgnoredGivesZeros) {
  OptionCase o{"ign", Reduction::kMean, 0.1f, 1e-3f, 0, true, true, false, 1.0, 0};
  RandomProblem rp = RandomProblem::Make(MakeSpec({"i", 12, 16, 50}, o, DType::kBF16, 4));
  const LossProblem p = rp.problem();
  ReferenceOutputs ref;
  ASSERT_TRUE(ReferenceCompute(p, &ref).ok());
  HostOutputs out(p, DType::kBF16);
  ASSERT_TRUE(backend_->Compute(p, out.outputs(), nullptr).ok());
  EXPECT_EQ(out.loss[0], 0.0f);
  EXPECT_EQ(out.tokens, 0);
  EXPECT_TRUE(MatchesReference(p, rp.stats(), ref, out.outputs()));
}

TEST_F(CudaTest, EmptyBatch) {
  RandomProblem rp = RandomProblem::Make(MakeSpec({"e", 1, 16, 50}, {"e"}, DType::kF32, 4));
  LossProblem p = rp.problem();
  p.bt = 0;
  HostOutputs out(p, DType::kF32);
  ASSERT_TRUE(backend_->Compute(p, out.outputs(), nullptr).ok());
  EXPECT_EQ(out.loss[0], 0.0f);
  EXPECT_EQ(out.tokens, 0);
  for (size_t k = 0; k < out.dw.size(); ++k) ASSERT_EQ(out.dw[k], 0) << k;
}

TEST_F(CudaTest, BadInputIsInvalidArgument) {
  RandomProblem rp = RandomProblem::Make(MakeSpec({"b", 8, 16, 50}, {"b"}, DType::kBF16, 4));
  HostOutputs out(rp.problem(), DType::kBF16);
  // The backend assumes a valid problem: a bad one is refused by the validation it is handed
  // through (testing/test_util.h), as the engine hands it every problem.
  LossProblem p = rp.problem();
  p.h = 0;
  EXPECT_TRUE(absl::IsInvalidArgument(ValidateThenCompute(*backend_, p, out.outputs(), nullptr)));
  p = rp.problem();
  rp.targets[3] = 50;
  p = rp.problem();
  absl::Status st = ValidateThenCompute(*backend_, p, out.outputs(), nullptr);
  EXPECT_TRUE(absl::IsInvalidArgument(st)) << st;
  EXPECT_NE(st.message().find("targets[3]"), std::string::npos) << st;
  rp.targets[3] = 1;
  p = rp.problem();
  LossOutputs lo = out.outputs();
  lo.grad_dtype = DType::kI32;
  EXPECT_TRUE(absl::IsInvalidArgument(ValidateThenCompute(*backend_, p, lo, nullptr)));
  p.options.label_smoothing = 2.0f;
  EXPECT_TRUE(absl::IsInvalidArgument(ValidateThenCompute(*backend_, p, out.outputs(), nullptr)));
  EXPECT_TRUE(backend_->Info().healthy);
}

TEST_F(CudaTest, OutOfMemoryIsResourceExhaustedAndTheBackendKeepsServing) {
  // More than the device has.
  const BackendInfo before = backend_->Info();
  ASSERT_GT(before.memory_total_bytes, 0u);
  auto huge = backend_->Allocate(before.memory_total_bytes * 2);
  ASSERT_FALSE(huge.ok());
  EXPECT_TRUE(absl::IsResourceExhausted(huge.status())) << huge.status();
  // A budget smaller than the problem.
  CudaBackendOptions small;
  small.memory_budget_bytes = 1 << 20;
  auto tight = CudaBackend::Create(small);
  ASSERT_TRUE(tight.ok());
  RandomProblem rp = RandomProblem::Make(MakeSpec({"o", 64, 64, 4000}, {"o"}, DType::kF32, 4));
  const LossProblem p = rp.problem();
  HostOutputs out(p, DType::kF32);
  // 1 GiB freed into the device's pool, which keeps it ...
  { ASSERT_TRUE(backend_->Allocate(1ull << 30).ok()); }
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const uint64_t kept = backend_->Info().memory_used_bytes;
  absl::Status st = (*tight)->Compute(p, out.outputs(), nullptr);
  EXPECT_TRUE(absl::IsResourceExhausted(st)) << st;
  EXPECT_GT((*tight)->WorkspaceBytes(ShapeOf(p, out.outputs())), small.memory_budget_bytes);
  // ... until a request runs out of memory: then the pool gives back what it does not use.
  EXPECT_LE(backend_->Info().memory_used_bytes + (512ull << 20), kept)
      << "the pool kept its unused memory after an out-of-memory";
  // Both keep serving.
  ReferenceOutputs ref;
  ASSERT_TRUE(ReferenceCompute(p, &ref).ok());
  out.Poison();
  ASSERT_TRUE(backend_->Compute(p, out.outputs(), nullptr).ok());
  EXPECT_TRUE(MatchesReference(p, rp.stats(), ref, out.outputs()));
  EXPECT_TRUE(backend_->Info().healthy);
  EXPECT_TRUE((*tight)->Info().healthy);
}

TEST_F(CudaTest, InfoReportsTheDevice) {
  const BackendInfo info = backend_->Info();
  EXPECT_EQ(info.name, "cuda");
  EXPECT_FALSE(info.device.empty());
  EXPECT_GT(info.memory_total_bytes, 0u);
  EXPECT_GT(info.memory_used_bytes, 0u);
  EXPECT_TRUE(info.healthy);
  // What it holds follows its buffers (the caching pool keeps freed memory, which `used`
  // still counts), and its budget is the option's.
  CudaBackendOptions o;
  o.memory_budget_bytes = 256u << 20;
  auto b = CudaBackend::Create(o);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ((*b)->Info().memory_budget_bytes, o.memory_budget_bytes);
  const uint64_t held = (*b)->Info().memory_held_bytes;
  {
    auto buf = (*b)->Allocate(64u << 20);
    ASSERT_TRUE(buf.ok()) << buf.status();
    EXPECT_GE((*b)->Info().memory_held_bytes, held + (64u << 20));
  }
  EXPECT_EQ((*b)->Info().memory_held_bytes, held);
  EXPECT_EQ(backend_->Info().memory_budget_bytes, 0u);  // the fixture's: none
}

// The two backends agree with each other as closely as each agrees with the reference.
TEST_F(CudaTest, AgreesWithTheCpuBackend) {
  std::unique_ptr<Backend> cpu = NewCpuBackend(2);
  for (DType dtype : {DType::kBF16, DType::kF32}) {
    for (int oi : {0, 3, 5}) {
      const OptionCase& o = kOptions[oi];
      RandomProblem rp = RandomProblem::Make(MakeSpec(kShapes[2], o, dtype, 77 + oi));
      const LossProblem p = rp.problem();
      const DType g = o.grad_f32 ? DType::kF32 : dtype;
      HostOutputs a(p, g), b(p, g);
      ASSERT_TRUE(backend_->Compute(p, a.outputs(), nullptr).ok());
      ASSERT_TRUE(cpu->Compute(p, b.outputs(), nullptr).ok());
      // Each backend against the float64 reference first (every output, the table's bounds);
      // then against each other, within the sum of the two backends' bounds.
      ReferenceOutputs ref;
      ASSERT_TRUE(ReferenceCompute(p, &ref).ok());
      EXPECT_TRUE(MatchesReference(p, rp.stats(), ref, a.outputs())) << "cuda " << o.name;
      EXPECT_TRUE(MatchesReference(p, rp.stats(), ref, b.outputs())) << "cpu " << o.name;
      const Tolerance tol = ToleranceFor(dtype, g);
      const double bound = 2 * (2 * tol.logit_u * rp.stats().rms_row_abs_max + tol.logit_u +
                                tol.grad_u + tol.fp32_rel);
      const size_t n_dx = p.bt * p.h, n_dw = p.v * p.h;
      CompareResult r = CompareRelNorm("dx cuda vs cpu", Widen(b.dx.data(), g, n_dx),
                                       Widen(a.dx.data(), g, n_dx), bound);
      EXPECT_TRUE(r.ok()) << DTypeName(dtype) << " " << o.name << ": " << r.ToString();
      r = CompareRelNorm("dw cuda vs cpu", Widen(b.dw.data(), g, n_dw),
                         Widen(a.dw.data(), g, n_dw), bound);
      EXPECT_TRUE(r.ok()) << DTypeName(dtype) << " " << o.name << ": " << r.ToString();
      EXPECT_EQ(a.tokens, b.tokens);
    }
  }
}

// The bias is part of the logits before they are stored (DESIGN.md: z = X W^T + b, stored in
// the input dtype), on both backends and in every schedule. X and W hold small integers, so
// X W^T is exact in fp32 and lands in [256, 576], where bf16 steps by 2 or 4, and the bias
// holds quarters: bf16(X W^T + b) and bf16(X W^T) + b differ by up to 2 there. With the logits
// equal the two backends differ only by fp32 arithmetic in the CE; rounding the bias
// separately moves a row's lse by up to 2 (about 4e-3 relative), 400 times the bound below.
TEST_F(CudaTest, BiasIsRoundedWithTheLogitsAsOnTheCpu) {
  std::unique_ptr<Backend> cpu = NewCpuBackend(2);
  OptionCase o = kOptions[0];
  o.bias = true;
  struct Config {
    const char* name;
    Schedule schedule;
    bool whole_batch;
    int64_t bt;  // the whole-batch layout needs BT * 2 <= 4 H
  };
  for (const Config& c : {Config{"rows", Schedule::kRowHalves, false, 700},
                          Config{"columns", Schedule::kColumnHalves, false, 700},
                          Config{"whole batch", Schedule::kRowHalves, true, 120}}) {
    CudaBackendOptions bo;
    bo.schedule = c.schedule;
    bo.auto_schedule = false;
    bo.whole_batch = c.whole_batch;
    auto cuda = CudaBackend::Create(bo);
    ASSERT_TRUE(cuda.ok()) << cuda.status();
    RandomProblem rp = RandomProblem::Make(MakeSpec({"b", c.bt, 64, 1536}, o, DType::kBF16, 21));
    uint64_t state = 12345;
    auto next = [&state] {
      state = state * 6364136223846793005ull + 1442695040888963407ull;
      return static_cast<int>(state >> 33);
    };
    for (size_t i = 0; i < rp.x.size() / 2; ++i) {
      StoreFromFloat(rp.x.data(), DType::kBF16, i, static_cast<float>(2 + next() % 2));
    }
    for (size_t i = 0; i < rp.w.size() / 2; ++i) {
      StoreFromFloat(rp.w.data(), DType::kBF16, i, static_cast<float>(2 + next() % 2));
    }
    for (size_t j = 0; j < rp.bias.size() / 2; ++j) {
      StoreFromFloat(rp.bias.data(), DType::kBF16, j, 0.25f * static_cast<float>(next() % 7 - 3));
    }
    rp.RecomputeStats();
    const LossProblem p = rp.problem();
    HostOutputs a(p, DType::kBF16), b(p, DType::kBF16);
    ASSERT_TRUE((*cuda)->Compute(p, a.outputs(), nullptr).ok()) << c.name;
    ASSERT_TRUE(cpu->Compute(p, b.outputs(), nullptr).ok()) << c.name;
    double worst = 0;
    for (int64_t i = 0; i < p.bt; ++i) {
      worst = std::max(worst, std::abs(static_cast<double>(a.lse[i]) - b.lse[i]) /
                                  std::abs(static_cast<double>(b.lse[i])));
    }
    EXPECT_LE(worst, 1e-5) << c.name << ": largest relative lse difference, cuda vs cpu";
  }
}

// The overlapped path (LossProblem::rows): X released in uneven steps while the Compute runs,
// unreleased rows NaN. Every output must equal the whole-X Compute's byte for byte, in both
// schedules, over several chunks (odd BT, so the last chunk is short), with a fresh dW and an
// accumulator. Each backend is fresh and its first Compute of a shape is the streamed one, so
// the autotuning trials run before any row of X is on the device (and must leave an
// accumulator as it was). DxReady comes once per chunk in increasing rows, ending at BT.
TEST_F(CudaTest, StreamedRowsGiveTheWholeProblemsBytes) {
  struct Config {
    Schedule schedule;
    int64_t bt, chunk_rows;  // chunk_rows >= 512: the row halves split inside each chunk
  };
  const Config configs[] = {{Schedule::kRowHalves, 1201, 512},
                            {Schedule::kRowHalves, 47, 10},
                            {Schedule::kColumnHalves, 1201, 512},
                            {Schedule::kColumnHalves, 47, 10}};
  uint64_t seed = 900;
  for (const Config& c : configs) {
    for (bool autotune : {true, false}) {
      CudaBackendOptions bo;
      bo.schedule = c.schedule;
      bo.auto_schedule = false;
      bo.autotune_gemms = autotune;
      auto b = CudaBackend::Create(bo);
      ASSERT_TRUE(b.ok()) << b.status();
      for (int oi : {3, 5, 6}) {  // mean_all, grad_f32, accumulate
        OptionCase o = kOptions[oi];
        o.chunk_rows = c.chunk_rows;
        for (DType dtype : {DType::kBF16, DType::kF32}) {
          ++seed;
          RandomProblem rp =
              RandomProblem::Make(MakeSpec({"stream", c.bt, 48, 1000}, o, dtype, seed));
          const LossProblem whole = rp.problem();
          const DType g = o.grad_f32 ? DType::kF32 : dtype;
          const std::string where = absl::StrCat(
              "schedule ", static_cast<int>(c.schedule), " bt ", c.bt, " autotune ", autotune,
              " ", o.name, " ", DTypeName(dtype));
          TrickleRows::Spec ts;
          ts.steps = 4 + static_cast<int>(seed % 4);  // 4 to 7 releases
          ts.seed = seed;
          TrickleRows rows(whole.x, whole.bt, whole.h * DTypeSize(dtype), ts);
          LossProblem streamed = whole;
          streamed.x = rows.x();
          streamed.rows = &rows;
          HostOutputs got(whole, g, /*want_grads=*/true, o.accumulate);
          const absl::Status st = (*b)->Compute(streamed, got.outputs(), nullptr);
          ASSERT_TRUE(st.ok()) << where << ": " << st;
          HostOutputs want(whole, g, /*want_grads=*/true, o.accumulate);
          ASSERT_TRUE((*b)->Compute(whole, want.outputs(), nullptr).ok()) << where;
          EXPECT_TRUE(BitIdentical(want, got)) << where;

          // One DxReady per chunk.
          EXPECT_TRUE(rows.CallsAreValid(
              whole.bt, static_cast<size_t>((c.bt + c.chunk_rows - 1) / c.chunk_rows)))
              << where;
        }
      }
    }
  }
}

// Without dX wanted there is nothing to report; the other outputs still match the whole X.
TEST_F(CudaTest, StreamedRowsWithoutDxReportNothing) {
  OptionCase o = kOptions[4];  // chunked_bias_ignore: 7-row chunks
  RandomProblem rp = RandomProblem::Make(MakeSpec(kShapes[1], o, DType::kBF16, 12));
  const LossProblem whole = rp.problem();
  HostOutputs want(whole, DType::kBF16), got(whole, DType::kBF16);
  LossOutputs want_out = want.outputs(), got_out = got.outputs();
  want_out.dx = got_out.dx = nullptr;
  ASSERT_TRUE(backend_->Compute(whole, want_out, nullptr).ok());
  TrickleRows rows(whole.x, whole.bt, whole.h * DTypeSize(whole.dtype), TrickleRows::Spec{});
  LossProblem streamed = whole;
  streamed.x = rows.x();
  streamed.rows = &rows;
  ASSERT_TRUE(backend_->Compute(streamed, got_out, nullptr).ok());
  EXPECT_TRUE(BitIdentical(want, got));
  EXPECT_TRUE(rows.dx_ready().empty()) << rows.dx_ready().size() << " DxReady calls";
  ASSERT_FALSE(rows.waits().empty());
  EXPECT_EQ(rows.waits().back(), whole.bt);
}

// A WaitX that fails ends the Compute with its status; no row past the released ones is
// reported ready, and the backend keeps serving.
TEST_F(CudaTest, FailedRowWaitEndsTheComputeWithItsStatus) {
  OptionCase o = kOptions[0];
  o.chunk_rows = 10;
  for (const absl::Status& failure :
       {absl::CancelledError("test: the client went away"),
        absl::DeadlineExceededError("test: rows stalled")}) {
    for (int64_t fail_after : {0, 20, 46}) {
      RandomProblem rp =
          RandomProblem::Make(MakeSpec(kShapes[1], o, DType::kBF16, 80 + fail_after));
      const std::unique_ptr<TrickleRows> rows = ExpectComputeEndsWithTheFailedWait(
          [&](const LossProblem& p, const LossOutputs& out) {
            return backend_->Compute(p, out, nullptr);
          },
          rp.problem(), failure, fail_after);
      // Compute drained the device before it returned: no DxReady can come later.
      const size_t ready = rows->dx_ready().size();
      absl::SleepFor(absl::Milliseconds(5));
      EXPECT_EQ(rows->dx_ready().size(), ready) << "a DxReady after Compute returned";
      EXPECT_TRUE(backend_->Info().healthy);
    }
  }
  // Still serving, and right.
  RandomProblem rp = RandomProblem::Make(MakeSpec(kShapes[1], o, DType::kBF16, 99));
  const LossProblem p = rp.problem();
  ReferenceOutputs ref;
  ASSERT_TRUE(ReferenceCompute(p, &ref).ok());
  HostOutputs out(p, DType::kBF16);
  ASSERT_TRUE(backend_->Compute(p, out.outputs(), nullptr).ok());
  EXPECT_TRUE(MatchesReference(p, rp.stats(), ref, out.outputs()));
}

// Rows still arriving never take the whole-batch layout (each of its GEMMs reads every row);
// no rows at all: nothing to wait for, nothing to report.
TEST_F(CudaTest, StreamedRowsTakeRowChunksAndAnEmptyBatchWaitsForNothing) {
  CudaBackendOptions bo;
  bo.whole_batch = true;
  auto b = CudaBackend::Create(bo);
  ASSERT_TRUE(b.ok()) << b.status();
  RandomProblem rp = RandomProblem::Make(MakeSpec({"w", 200, 128, 3000}, {"w"}, DType::kBF16, 3));
  LossProblem p = rp.problem();
  HostOutputs out(p, DType::kBF16);
  ASSERT_GT((*b)->Plan(p, out.outputs()).blocks, 0) << "the shape must fit the whole batch";
  TrickleRows rows(p.x, p.bt, p.h * DTypeSize(p.dtype), TrickleRows::Spec{});
  p.x = rows.x();
  p.rows = &rows;
  EXPECT_EQ((*b)->Plan(p, out.outputs()).blocks, 0);
  ASSERT_TRUE((*b)->Compute(p, out.outputs(), nullptr).ok());
  ReferenceOutputs ref;
  ASSERT_TRUE(ReferenceCompute(rp.problem(), &ref).ok());
  EXPECT_TRUE(MatchesReference(rp.problem(), rp.stats(), ref, out.outputs()));

  LossProblem empty = rp.problem();
  empty.bt = 0;
  TrickleRows none(empty.x, 0, empty.h * DTypeSize(empty.dtype), TrickleRows::Spec{});
  empty.x = none.x();
  empty.rows = &none;
  HostOutputs eout(empty, DType::kBF16);
  ASSERT_TRUE(backend_->Compute(empty, eout.outputs(), nullptr).ok());
  EXPECT_EQ(eout.tokens, 0);
  EXPECT_TRUE(none.dx_ready().empty());
  for (int64_t r : none.waits()) EXPECT_EQ(r, 0);
}

}  // namespace
}  // namespace cuda
}  // namespace lossd
