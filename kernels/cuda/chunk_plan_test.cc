// SPDX-License-Identifier: Apache-2.0
// The chunk plans (host-side arithmetic only): run everywhere the toolkit is, GPU or not.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/cuda/chunk_plan.h"
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

// The reference-exp path's buffers: each 256-byte aligned, none overlapping another, every one
// of its size (the statistics padded to the CTA tile), all within the layout's bytes.
TEST(RefExpPlanTest, LayoutHoldsEveryBuffer) {
  for (const auto& [c, h, v] : {std::tuple<int64_t, int64_t, int64_t>{300, 96, 1000},
                                {2048, 2304, 256000},
                                {1, 8, 16}}) {
    const RefExpLayout l = RefExpLayoutOf(c, h, v);
    EXPECT_EQ(l.ld % 128, 0);
    EXPECT_GE(l.ld, c);
    EXPECT_EQ(l.n_tiles, (v + 127) / 128);
    EXPECT_EQ(l.n_sample, std::min<int64_t>(1024, v));
    const uint64_t stats = static_cast<uint64_t>(l.n_tiles) * l.ld * 4;
    // (offset, bytes) in layout order.
    const std::vector<std::pair<uint64_t, uint64_t>> parts = {
        {l.tile_sum, stats}, {l.tile_max, stats}, {l.tile_arg, stats},
        {l.ref, static_cast<uint64_t>(l.ld) * 4}, {l.zt, c * 4u}, {l.factor, c * 4u},
        {l.zs, static_cast<uint64_t>(c) * l.n_sample * 4},
        {l.w_sample, static_cast<uint64_t>(l.n_sample) * h * 2},
        {l.xs, static_cast<uint64_t>(c) * h * 2}, {l.dx32, static_cast<uint64_t>(c) * h * 4},
        {l.bad, 12}, {l.gemm, kRefExpGemmWorkspaceBytes},
        {l.row_bad, static_cast<uint64_t>(l.ld) * 4}, {l.row_max, static_cast<uint64_t>(l.ld) * 4},
        {l.redo_idx, static_cast<uint64_t>(l.ld) * 4},
        {l.redo_ref, (kRefExpRedoMax + kRefExpTileM) * 4u},
        {l.redo_x, static_cast<uint64_t>(kRefExpRedoRows) * h * 2},
        {l.redo_e, static_cast<uint64_t>(kRefExpRedoRows) * v * 2},
        {l.redo_sum, static_cast<uint64_t>(l.n_tiles) * kRefExpTileM * 4},
        {l.redo_max, static_cast<uint64_t>(l.n_tiles) * kRefExpTileM * 4},
        {l.redo_arg, static_cast<uint64_t>(l.n_tiles) * kRefExpTileM * 4}};
    for (size_t i = 0; i < parts.size(); ++i) {
      EXPECT_EQ(parts[i].first % 256, 0u) << i;
      const uint64_t end = parts[i].first + parts[i].second;
      EXPECT_LE(end, i + 1 < parts.size() ? parts[i + 1].first : l.bytes) << i;
    }
  }
}

// Within the budget it is given, and at the default budget the same chunk rows as the default
// path plans (the chunk's length is what the GEMMs' efficiency depends on).
TEST(RefExpPlanTest, SharesTheBudgetAndKeepsTheDefaultChunk) {
  for (const auto& [bt, h, v] : {std::tuple<int64_t, int64_t, int64_t>{8192, 4096, 128256},
                                 {8192, 2304, 256000},
                                 {16384, 4096, 128256},
                                 {300, 96, 1000}}) {
    SCOPED_TRACE(v);
    const ChunkPlan base =
        PlanChunks(bt, v, DType::kBF16, DefaultChunkBudget(bt, v, DType::kBF16), 0);
    const uint64_t budget = DefaultRefExpBudget(bt, h, v);
    const ChunkPlan p = PlanRefExpChunks(bt, h, v, budget, 0);
    EXPECT_TRUE(p.ref_exp);
    EXPECT_EQ(p.chunk_rows, base.chunk_rows);
    EXPECT_LE(p.workspace_bytes, budget);
    // The default path's chunk buffer and GEMM workspaces, and the layout: nothing else.
    EXPECT_EQ(p.workspace_bytes, base.workspace_bytes + RefExpLayoutOf(p.chunk_rows, h, v).bytes);
  }
  // A small budget: fewer rows, still within it; an explicit chunk_rows wins.
  const ChunkPlan small = PlanRefExpChunks(8192, 2304, 256000, 256ull << 20, 0);
  EXPECT_LE(small.workspace_bytes, 256ull << 20);
  EXPECT_GT(small.chunk_rows, 64);
  EXPECT_EQ(PlanRefExpChunks(8192, 2304, 256000, 256ull << 20, 100).chunk_rows, 100);
}

// Which shapes are planned for the reference-exp path: bf16 cross-entropy without a bias,
// H and V multiples of 8, bf16 or fp32 gradients; each other case on its own.
TEST(RefExpPlanTest, PlannableShapes) {
  WorkspaceShape s;
  s.bt = 300;
  s.h = 96;
  s.v = 1000;
  s.want_dx = true;
  s.dw = GradOut::kAccumulated;
  EXPECT_TRUE(RefExpPlannable(s));
  WorkspaceShape f32 = s;
  f32.grad_dtype = DType::kF32;
  EXPECT_TRUE(RefExpPlannable(f32));
  WorkspaceShape streamed = s;
  streamed.rows_streamed = true;
  EXPECT_TRUE(RefExpPlannable(streamed));
  auto without = [&](auto change) {
    WorkspaceShape t = s;
    change(t);
    return RefExpPlannable(t);
  };
  EXPECT_FALSE(without([](WorkspaceShape& t) { t.dtype = DType::kF16; }));
  EXPECT_FALSE(without([](WorkspaceShape& t) { t.dtype = DType::kF32; }));
  EXPECT_FALSE(without([](WorkspaceShape& t) { t.has_bias = true; }));
  EXPECT_FALSE(without([](WorkspaceShape& t) { t.db = GradOut::kWritten; }));
  EXPECT_FALSE(without([](WorkspaceShape& t) { t.h = 31; }));
  EXPECT_FALSE(without([](WorkspaceShape& t) { t.v = 1001; }));
  EXPECT_FALSE(without([](WorkspaceShape& t) { t.grad_dtype = DType::kF16; }));
  EXPECT_FALSE(without([](WorkspaceShape& t) { t.kind = LossKind::kLogprob; }));
  EXPECT_FALSE(without([](WorkspaceShape& t) { t.kind = LossKind::kDistill; }));
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
