// SPDX-License-Identifier: Apache-2.0
// The CPU backend's interface around a Compute, each against the plain Compute or the
// float64 reference: accumulators across micro-batches, the non-finite statistics, partial
// outputs, weights in backend memory, refusals of invalid problems, its buffers, and the
// default chunk bound.
#include "kernels/cpu/cpu_backend.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "core/dtype.h"
#include "core/loss_problem.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/cpu/reference.h"
#include "testing/test_util.h"

namespace lossd {
namespace {

TEST(CpuBackendTest, AccumulatingMicroBatchesEqualsOneBatch) {
  RandomProblemSpec spec = ShapeSpec(4 * 37, 48, 300);
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
  RandomProblemSpec spec = ShapeSpec(20, 8, 30);
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
  RandomProblemSpec spec = ShapeSpec(24, 16, 37);
  spec.bias = true;
  spec.options.reduction = Reduction::kSum;
  auto compute = [](const LossProblem& p, const LossOutputs& o, LossStats* stats) {
    return NewCpuBackend(2)->Compute(p, o, stats);
  };
  for (DType grad : {DType::kF32, DType::kBF16}) {
    spec.dtype = grad;
    ASSERT_NO_FATAL_FAILURE(ExpectOverflowingGradientsReported(compute, spec));
  }
  // Into an accumulator (finite before): its sum is what the bits describe.
  spec.options.grad_scale = 3e38f;
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
            kNonFiniteDw | (HasNonFinite(db_acc.data(), DType::kF32, p.v) ? kNonFiniteDb : 0u));
}

TEST(CpuBackendTest, OnlyTheLossRequested) {
  RandomProblemSpec spec = ShapeSpec(10, 8, 30);
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
  RandomProblemSpec spec = ShapeSpec(12, 16, 40);
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
  EXPECT_TRUE(BitIdentical(dev, host));
}

TEST(CpuBackendTest, RejectsBadInputWithInvalidArgument) {
  RandomProblemSpec spec = ShapeSpec(5, 4, 6);
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
