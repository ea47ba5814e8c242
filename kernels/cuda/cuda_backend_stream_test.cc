// SPDX-License-Identifier: Apache-2.0
// GPU tests of the CUDA backend's overlapped path (LossProblem::rows): X arriving while the
// Compute runs gives the whole problem's bytes in both schedules, dX leaves chunk by chunk, a
// failed row wait ends the Compute with its status, and an empty batch waits for nothing.
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
#include "core/dtype.h"
#include "core/loss_problem.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/reference.h"
#include "kernels/cuda/fused_loss.h"
#include "testing/cuda/cuda_test_fixture.h"
#include "testing/test_util.h"

namespace lossd {
namespace cuda {
namespace {

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
      CudaBackendOptions bo = FixedSchedule(c.schedule);
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
          TrickleRows rows(whole, ts);
          const LossProblem streamed = rows.Streamed(whole);
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
  TrickleRows rows(whole, TrickleRows::Spec{});
  const LossProblem streamed = rows.Streamed(whole);
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
  TrickleRows rows(p, TrickleRows::Spec{});
  p = rows.Streamed(p);
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
