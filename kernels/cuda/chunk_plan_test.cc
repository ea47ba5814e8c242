// The chunk plans (host-side arithmetic only): run everywhere the toolkit is, GPU or not.
#include <cmath>
#include <cstdint>

#include "gtest/gtest.h"
#include "kernels/cuda/fused_loss.h"
#include "core/dtype.h"

namespace lossd {
namespace cuda {
namespace {

TEST(ChunkPlanTest, FromBudgetAndShape) {
  // The Llama-3 head at the default budget: four equal chunks of 2048 rows, within 512 MiB.
  const ChunkPlan p = PlanChunks(8192, 128256, DType::kBF16, kDefaultChunkBudgetBytes, 0);
  EXPECT_EQ(p.chunk_rows, 2048);
  EXPECT_LE(p.workspace_bytes, kDefaultChunkBudgetBytes);
  // Small problems take one chunk; an explicit chunk_rows wins.
  EXPECT_EQ(PlanChunks(47, 123, DType::kF32, kDefaultChunkBudgetBytes, 0).chunk_rows, 47);
  EXPECT_EQ(PlanChunks(47, 123, DType::kF32, kDefaultChunkBudgetBytes, 5).chunk_rows, 5);
  // fp32 logits take twice the bytes: half the rows.
  EXPECT_EQ(PlanChunks(8192, 128256, DType::kF32, kDefaultChunkBudgetBytes, 0).chunk_rows,
            1024);
}

// The gradient's scales: alpha times the stored ce (z) scale is the true one, and the stored
// gradient keeps the class weights' magnitude out (power-of-two factors, exact in fp32).
TEST(GradScalesTest, TheClassWeightsMagnitudeGoesIntoAlpha) {
  LossOptions o;
  o.reduction = Reduction::kMean;
  o.grad_scale = 0.75f;
  TargetSummary s;
  s.tokens = 1000;
  s.weight_sum = 1000;  // no class weights
  GradScales g = ComputeGradScales(o, s);
  EXPECT_EQ(g.ce, 1.0f);
  EXPECT_FLOAT_EQ(g.alpha, 0.75f / 1000);
  EXPECT_FLOAT_EQ(g.alpha * g.z, 0.75f / 1000);
  // Weights of about 1e-6 (summing to ~1 over a million classes): cw_t / 2^-19 is in
  // [0.5, 1) at the largest, so an fp16 G does not underflow.
  s.weight_sum = 1.2e-3;
  s.class_weight_max_abs = 1.5e-6;  // = 0.786 * 2^-19
  g = ComputeGradScales(o, s);
  EXPECT_EQ(g.ce, 524288.0f);  // 2^19
  EXPECT_FLOAT_EQ(static_cast<double>(g.alpha) * g.ce, 0.75 / 1.2e-3);
  EXPECT_FLOAT_EQ(static_cast<double>(g.alpha) * g.z, 0.75 / 1000);
  EXPECT_LT(1.5e-6 * g.ce, 1.0);
  EXPECT_GE(1.5e-6 * g.ce, 0.5);
  // Large weights: cw_t times the stored scale stays below 1 too.
  s.weight_sum = 7e7;
  s.class_weight_max_abs = 7e4;
  g = ComputeGradScales(o, s);
  EXPECT_LT(7e4 * g.ce, 1.0);
  EXPECT_FLOAT_EQ(static_cast<double>(g.alpha) * g.ce, 0.75 / 7e7);
  // Reduction none: the upstream gradient's magnitude and the weights' both go to alpha.
  o.reduction = Reduction::kNone;
  s.row_grad_max_abs = 3.0;        // 2^2 above it
  s.class_weight_max_abs = 1e-6;   // 2^-19 above it
  g = ComputeGradScales(o, s);
  EXPECT_EQ(g.ce, g.z);
  EXPECT_EQ(static_cast<double>(g.alpha) * g.ce, 1.0);
  EXPECT_EQ(g.ce, std::ldexp(1.0f, -2 + 19));
}

TEST(ChunkPlanTest, DefaultBudgetHoldsTwoThousandRows) {
  // The reference shape keeps 512 MiB (2048 rows fit in it).
  EXPECT_EQ(DefaultChunkBudget(8192, 128256, DType::kBF16), kDefaultChunkBudgetBytes);
  // V = 256000: grown to 2048 rows plus the two workspaces, and planned as 2048-row chunks.
  const uint64_t wide = DefaultChunkBudget(8192, 256000, DType::kBF16);
  EXPECT_EQ(wide, 2048ull * 256000 * 2 + 2 * kGemmWorkspaceBytes);
  EXPECT_EQ(PlanChunks(8192, 256000, DType::kBF16, wide, 0).chunk_rows, 2048);
  // A short batch needs only its own rows; fp32 logits twice the bytes of bf16.
  EXPECT_EQ(DefaultChunkBudget(1500, 256000, DType::kBF16),
            1500ull * 256000 * 2 + 2 * kGemmWorkspaceBytes);
  EXPECT_EQ(PlanChunks(1500, 256000, DType::kBF16, DefaultChunkBudget(1500, 256000, DType::kBF16),
                       0)
                .chunk_rows,
            1500);
  // Below the floor's rows the 512 MiB floor stands.
  EXPECT_EQ(DefaultChunkBudget(1000, 256000, DType::kBF16), kDefaultChunkBudgetBytes);
  EXPECT_EQ(DefaultChunkBudget(8192, 256000, DType::kF32), 2048ull * 256000 * 4 +
                                                              2 * kGemmWorkspaceBytes);
  // Never above the ceiling, never below the floor.
  EXPECT_EQ(DefaultChunkBudget(8192, 4000000, DType::kBF16), kMaxDefaultChunkBudgetBytes);
  EXPECT_EQ(DefaultChunkBudget(1, 8, DType::kBF16), kDefaultChunkBudgetBytes);
}


TEST(ChunkPlanTest, RowSplitHalvesFromFiveHundredTwelveRows) {
  EXPECT_EQ(RowSplit(511), 511);  // one piece
  EXPECT_EQ(RowSplit(512), 256);
  EXPECT_EQ(RowSplit(2048), 1024);
  const int64_t s = RowSplit(1201);
  EXPECT_EQ(s % 64, 0);
  EXPECT_GT(s, 0);
  EXPECT_LT(s, 1201);
}

// Autotuning's classes: exact up to 64, then eight steps an octave, never below the size and
// at most 12.5% above it; a size already on a step is its own class.
TEST(ChunkPlanTest, TuneClassRoundsUpToEightStepsAnOctave) {
  EXPECT_EQ(TuneClass(1), 1);
  EXPECT_EQ(TuneClass(64), 64);
  EXPECT_EQ(TuneClass(65), 72);
  EXPECT_EQ(TuneClass(488), 512);
  EXPECT_EQ(TuneClass(1000), 1024);
  EXPECT_EQ(TuneClass(1856), 1920);
  EXPECT_EQ(TuneClass(2048), 2048);
  EXPECT_EQ(TuneClass(2049), 2304);
  EXPECT_EQ(TuneClass(128256), 131072);
  for (int64_t x = 1; x < 70000; ++x) {
    const int64_t c = TuneClass(x);
    ASSERT_GE(c, x);
    ASSERT_LE(c, x <= 64 ? x : x + x / 8) << x;
    ASSERT_EQ(TuneClass(c), c) << x;  // a class is its own class
  }
}

}  // namespace
}  // namespace cuda
}  // namespace lossd
