// SPDX-License-Identifier: Apache-2.0
// GPU tests of the CUDA backend against the float64 reference: every option and dtype over
// tiny, odd, medium and realistic shapes, outputs poisoned before each run; determinism; both
// schedules, the whole-batch layout, autotuning; agreement with the CPU backend. The interface
// around a Compute is cuda_backend_api_test, the overlapped path cuda_backend_stream_test.
#include "kernels/cuda/cuda_backend.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <tuple>
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
#include "testing/cuda/cuda_test_fixture.h"
#include "testing/test_util.h"
#include "kernels/cuda/fused_loss.h"
#include "core/dtype.h"
#include "core/loss_problem.h"

namespace lossd {
namespace cuda {
namespace {

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
    CudaBackendOptions bo = FixedSchedule(schedule);
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
      CudaBackendOptions bo = FixedSchedule(schedule);
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
  // The device's default rows (2048; 4096 on an H100, device_tuning.h) fit in 2 GiB at both.
  const int64_t rows = backend_->default_chunk_rows();
  ASSERT_GE(rows, 2048) << backend_->tuning_reason();
  p.bt = 8192, p.h = 2304, p.v = 256000;  // the default budget grows to the default rows
  EXPECT_EQ(backend_->Plan(p, with_dw).chunk_rows, rows);
  EXPECT_EQ(backend_->Plan(p, with_dw).schedule, Schedule::kRowHalves);
  p.bt = 8192, p.h = 4096, p.v = 128256;
  EXPECT_EQ(backend_->Plan(p, with_dw).chunk_rows, rows);
  EXPECT_EQ(backend_->Plan(p, with_dw).schedule, Schedule::kRowHalves);
  p.bt = 1000, p.h = 64, p.v = 1000;  // one chunk: nothing to overlap across chunks
  EXPECT_EQ(backend_->Plan(p, with_dw).schedule, Schedule::kRowHalves);
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
    CudaBackendOptions bo = FixedSchedule(c.schedule);
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

}  // namespace
}  // namespace cuda
}  // namespace lossd
