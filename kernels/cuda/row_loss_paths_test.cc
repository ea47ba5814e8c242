// SPDX-License-Identifier: Apache-2.0
// GPU tests of the CUDA backend's logprob, policy and distill kinds along its other paths:
// both chunk schedules, the weights (the teacher's too) and the accumulators in backend memory,
// and rows of X that arrive while the Compute runs. Each comparison prints its largest errors.
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/dtype.h"
#include "core/loss_problem.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/cuda/cuda_backend.h"
#include "testing/cuda/cuda_test_fixture.h"
#include "testing/cuda/row_loss_test_cases.h"
#include "testing/test_util.h"

namespace lossd {
namespace cuda {
namespace {

// logprob with entropy (chunked, accumulated, fp32 gradients), policy (dapo), distill (JSD),
// policy's luspo with delta (chunked, accumulated).
constexpr int kPathCases[] = {2, 3, 8, 13};
constexpr Shape kMedium{"medium", 300, 96, 1000};

DType GradDType(const RowCase& c, DType dtype) { return c.grad_f32 ? DType::kF32 : dtype; }

TEST_F(CudaTest, RowLossBothSchedulesMatchReference) {
  for (Schedule schedule : {Schedule::kRowHalves, Schedule::kColumnHalves}) {
    absl::StatusOr<std::unique_ptr<CudaBackend>> b = CudaBackend::Create(FixedSchedule(schedule));
    ASSERT_TRUE(b.ok()) << b.status();
    for (int k : kPathCases) {
      const RowCase& c = kCases[k];
      RowProblem rp = MakeProblem(c, kMedium, DType::kBF16, 41 + k);
      rp.p.options.chunk_rows = 64;  // five chunks, the last short
      const DType grad = GradDType(c, DType::kBF16);
      const Expected e = ExpectOf(rp, ToleranceFor(DType::kBF16, grad));
      RowOutputs out(rp.p, grad, c.accumulate);
      LossStats stats;
      const absl::Status st = ValidateThenCompute(**b, rp.p, out.outputs(c.kind), &stats);
      ASSERT_TRUE(st.ok()) << st;
      EXPECT_EQ(stats.chunk_rows, 64);
      std::printf("  %s schedule %d:\n", c.name, static_cast<int>(schedule));
      ExpectMatches(rp.p, e, out, c.accumulate);
    }
  }
}

// W, the bias, the teacher's W and bias, and the accumulators in backend memory: the results
// of the host-memory problem, and a second micro-batch adds the same gradient again.
TEST_F(CudaTest, RowLossWeightsAndAccumulatorsInBackendMemory) {
  for (int k : kPathCases) {
    const RowCase& c = kCases[k];
    RowProblem rp = MakeProblem(c, kMedium, DType::kBF16, 51 + k);
    const DType grad = GradDType(c, DType::kBF16);
    const Expected e = ExpectOf(rp, ToleranceFor(DType::kBF16, grad));
    std::vector<std::unique_ptr<BackendBuffer>> held;
    // A backend copy of n host bytes.
    auto on_backend = [&](const void* src, size_t n) -> void* {
      absl::StatusOr<std::unique_ptr<BackendBuffer>> buf = backend_->Allocate(n);
      EXPECT_TRUE(buf.ok()) << buf.status();
      if (!buf.ok()) return nullptr;
      EXPECT_TRUE(backend_->CopyToBackend(**buf, 0, src, n).ok());
      held.push_back(*std::move(buf));
      return held.back()->data();
    };
    LossProblem p = rp.p;
    const size_t elem = DTypeSize(p.dtype);
    p.w = on_backend(p.w, p.v * p.h * elem);
    if (p.bias != nullptr) p.bias = on_backend(p.bias, p.v * elem);
    p.w_memory = Memory::kBackend;
    if (p.kind == LossKind::kDistill) {
      p.teacher_w = on_backend(p.teacher_w, p.v * p.teacher_h * elem);
      if (p.teacher_bias != nullptr) p.teacher_bias = on_backend(p.teacher_bias, p.v * elem);
      p.teacher_w_memory = Memory::kBackend;
    }
    const std::vector<float> zeros(p.v * p.h, 0.0f);
    auto* dw = static_cast<float*>(on_backend(zeros.data(), zeros.size() * 4));
    auto* db = static_cast<float*>(on_backend(zeros.data(), p.v * 4));
    ASSERT_FALSE(HasFailure());
    for (int step = 1; step <= 2; ++step) {
      RowOutputs out(p, grad, /*accumulate=*/true);
      LossOutputs o = out.outputs(c.kind);
      o.dw_accum = dw;
      o.db_accum = p.bias != nullptr ? db : nullptr;
      o.accum_memory = Memory::kBackend;
      const absl::Status st = ValidateThenCompute(*backend_, p, o, nullptr);
      ASSERT_TRUE(st.ok()) << st;
      // The accumulators, back on the host, hold `step` times the gradient.
      ASSERT_TRUE(backend_->CopyFromBackend(*held[held.size() - 2], 0, out.base.dw_accum.data(),
                                            out.base.dw_accum.size() * 4)
                      .ok());
      if (p.bias != nullptr) {
        ASSERT_TRUE(backend_->CopyFromBackend(*held.back(), 0, out.base.db_accum.data(),
                                              out.base.db_accum.size() * 4)
                        .ok());
      }
      Expected scaled = e;
      for (std::vector<double>* g : {&scaled.grad.dw, &scaled.grad.db}) {
        for (double& x : *g) x *= step;
      }
      std::printf("  %s, backend memory, micro-batch %d:\n", c.name, step);
      ExpectMatches(p, scaled, out, /*accumulate=*/true);
    }
  }
}

// Rows of X that arrive while the Compute runs give the bits of the whole X, and dX leaves in
// increasing row order.
TEST_F(CudaTest, RowLossStreamedRowsGiveTheSameBits) {
  for (int k : kPathCases) {
    const RowCase& c = kCases[k];
    RowProblem rp = MakeProblem(c, kMedium, DType::kBF16, 61 + k);
    rp.p.options.chunk_rows = 64;
    const DType grad = GradDType(c, DType::kBF16);
    RowOutputs want(rp.p, grad, c.accumulate), got(rp.p, grad, c.accumulate);
    ASSERT_TRUE(ValidateThenCompute(*backend_, rp.p, want.outputs(c.kind), nullptr).ok());
    TrickleRows rows(rp.p, TrickleRows::Spec{});
    const LossProblem streamed = rows.Streamed(rp.p);
    const absl::Status st = ValidateThenCompute(*backend_, streamed, got.outputs(c.kind), nullptr);
    ASSERT_TRUE(st.ok()) << st;
    EXPECT_TRUE(BitIdentical(want.base, got.base)) << c.name;
    EXPECT_EQ(0, std::memcmp(want.logp.data(), got.logp.data(), want.logp.size() * 4));
    EXPECT_EQ(0, std::memcmp(want.entropy.data(), got.entropy.data(), want.entropy.size() * 4));
    EXPECT_EQ(0, std::memcmp(&want.kl, &got.kl, 4));
    EXPECT_EQ(0, std::memcmp(&want.clip_fraction, &got.clip_fraction, 4));
    EXPECT_TRUE(rows.CallsAreValid(rp.p.bt, 5)) << c.name;  // one DxReady per chunk
  }
}

}  // namespace
}  // namespace cuda
}  // namespace lossd
