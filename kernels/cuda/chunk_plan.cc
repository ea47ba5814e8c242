// SPDX-License-Identifier: Apache-2.0
#include "kernels/cuda/chunk_plan.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "core/dtype.h"
#include "core/loss_problem.h"
#include "kernels/backend.h"
#include "kernels/cuda/ce_kernels.h"

namespace lossd {
namespace cuda {
namespace {

constexpr uint64_t kAlign = 256;

uint64_t RoundUp(uint64_t x, uint64_t m) { return (x + m - 1) / m * m; }

// The rows a chunk holds: `requested_rows` if set, else the most whose `row_bytes` each fit in
// `budget_bytes` beside `fixed`, balanced so the chunks are of equal size (a multiple of 64
// rows where it can be). At least 1.
int64_t ChunkRows(int64_t bt, uint64_t budget_bytes, uint64_t fixed, uint64_t row_bytes,
                  int64_t requested_rows) {
  if (requested_rows > 0) return std::min<int64_t>(requested_rows, std::max<int64_t>(bt, 1));
  const uint64_t avail = budget_bytes > fixed ? budget_bytes - fixed : 0;
  const int64_t cmax = std::max<int64_t>(1, static_cast<int64_t>(avail / row_bytes));
  if (cmax >= bt) return std::max<int64_t>(bt, 1);
  const int64_t n = (bt + cmax - 1) / cmax;
  int64_t c = (bt + n - 1) / n;
  // A multiple of 64 keeps the GEMM tiles full; take it only where it still fits.
  const int64_t rounded = (c + 63) / 64 * 64;
  if (c > 64 && rounded <= cmax) c = rounded;
  return c;
}

// RefExpLayoutOf's bytes for one more row, ignoring the padding of ld (the plans' estimate).
uint64_t RefExpRowBytes(int64_t h, int64_t v) {
  const uint64_t tiles =
      static_cast<uint64_t>((std::max<int64_t>(v, 1) + kRefExpTileN - 1) / kRefExpTileN);
  return 3 * 4 * tiles + 6 * 4 + 4 * static_cast<uint64_t>(std::min(kRefExpSample, v)) +
         6 * static_cast<uint64_t>(h);
}

}  // namespace

uint64_t DefaultChunkBudget(int64_t bt, int64_t v, DType dtype, uint64_t gemm_workspace_bytes,
                            int64_t min_rows) {
  const uint64_t rows =
      static_cast<uint64_t>(std::clamp<int64_t>(bt, 1, std::max<int64_t>(min_rows, 1)));
  const uint64_t want = RoundUp(rows * static_cast<uint64_t>(std::max<int64_t>(v, 1)) *
                                    DTypeSize(dtype),
                                kAlign) +
                        2 * RoundUp(gemm_workspace_bytes, kAlign);
  return std::clamp(want, kDefaultChunkBudgetBytes, kMaxDefaultChunkBudgetBytes);
}

ChunkPlan PlanChunks(int64_t bt, int64_t v, DType dtype, uint64_t budget_bytes,
                     int64_t requested_rows, Schedule schedule, uint64_t gemm_workspace_bytes) {
  const uint64_t fixed = 2 * RoundUp(gemm_workspace_bytes, kAlign);
  const uint64_t row_bytes = static_cast<uint64_t>(std::max<int64_t>(v, 1)) * DTypeSize(dtype);
  const int64_t c = ChunkRows(bt, budget_bytes, fixed, row_bytes, requested_rows);
  ChunkPlan plan;
  plan.chunk_rows = c;
  plan.schedule = schedule;
  plan.gemm_workspace_bytes = RoundUp(gemm_workspace_bytes, kAlign);
  plan.workspace_bytes = RoundUp(static_cast<uint64_t>(c) * row_bytes, kAlign) + fixed;
  return plan;
}

int64_t RefExpLd(int64_t rows) {
  return (rows + kRefExpTileM - 1) / kRefExpTileM * kRefExpTileM;
}

RefExpLayout RefExpLayoutOf(int64_t c, int64_t h, int64_t v) {
  RefExpLayout l;
  l.ld = RefExpLd(std::max<int64_t>(c, 1));
  l.n_tiles = (std::max<int64_t>(v, 1) + kRefExpTileN - 1) / kRefExpTileN;
  l.n_sample = std::min(kRefExpSample, std::max<int64_t>(v, 1));
  const uint64_t ld = static_cast<uint64_t>(l.ld), rows = static_cast<uint64_t>(c);
  const uint64_t stats = RoundUp(static_cast<uint64_t>(l.n_tiles) * ld * 4, kAlign);
  uint64_t at = 0;
  auto take = [&at](uint64_t bytes) {
    const uint64_t here = at;
    at += RoundUp(bytes, kAlign);
    return here;
  };
  l.tile_sum = take(stats);
  l.tile_max = take(stats);
  l.tile_arg = take(stats);
  l.ref = take(ld * 4);
  l.zt = take(rows * 4);
  l.factor = take(rows * 4);
  l.zs = take(rows * static_cast<uint64_t>(l.n_sample) * 4);
  l.w_sample = take(static_cast<uint64_t>(l.n_sample) * h * 2);
  l.xs = take(rows * h * 2);
  l.dx32 = take(rows * h * 4);
  l.bad = take(16);
  l.gemm = take(kRefExpGemmWorkspaceBytes);
  l.row_bad = take(ld * 4);
  l.row_max = take(ld * 4);
  l.redo_idx = take(ld * 4);
  l.redo_ref = take((kRefExpRedoMax + kRefExpTileM) * 4);
  const uint64_t redo_rows = static_cast<uint64_t>(kRefExpRedoRows);
  const uint64_t redo_stats = static_cast<uint64_t>(l.n_tiles) * kRefExpTileM * 4;
  l.redo_x = take(redo_rows * h * 2);
  l.redo_e = take(redo_rows * static_cast<uint64_t>(std::max<int64_t>(v, 1)) * 2);
  l.redo_sum = take(redo_stats);
  l.redo_max = take(redo_stats);
  l.redo_arg = take(redo_stats);
  l.bytes = at;
  return l;
}

bool RefExpPlannable(const WorkspaceShape& s) {
  return s.kind == LossKind::kCrossEntropy && s.dtype == DType::kBF16 && !s.has_bias &&
         s.db == GradOut::kNone && s.h % 8 == 0 && s.v % 8 == 0 &&
         (s.grad_dtype == DType::kBF16 || s.grad_dtype == DType::kF32);
}

ChunkPlan PlanRefExpChunks(int64_t bt, int64_t h, int64_t v, uint64_t budget_bytes,
                           int64_t requested_rows, uint64_t gemm_workspace_bytes) {
  const uint64_t gws = RoundUp(gemm_workspace_bytes, kAlign);
  const RefExpLayout none = RefExpLayoutOf(0, h, v);
  // The parts that do not grow with rows, and ld's padding of up to a tile of rows.
  const uint64_t fixed = 2 * gws + none.bytes + kRefExpTileM * RefExpRowBytes(h, v);
  const uint64_t row_bytes =
      static_cast<uint64_t>(std::max<int64_t>(v, 1)) * 2 + RefExpRowBytes(h, v);
  const int64_t c = ChunkRows(bt, budget_bytes, fixed, row_bytes, requested_rows);
  ChunkPlan plan;
  plan.chunk_rows = c;
  plan.schedule = Schedule::kRowHalves;
  plan.gemm_workspace_bytes = gws;
  plan.ref_exp = true;
  plan.workspace_bytes = RoundUp(static_cast<uint64_t>(c) * std::max<int64_t>(v, 1) * 2, kAlign) +
                         2 * gws + RefExpLayoutOf(c, h, v).bytes;
  return plan;
}

uint64_t DefaultRefExpBudget(int64_t bt, int64_t h, int64_t v, uint64_t gemm_workspace_bytes,
                             int64_t min_rows) {
  const uint64_t rows =
      static_cast<uint64_t>(std::clamp<int64_t>(bt, 1, std::max<int64_t>(min_rows, 1)));
  const uint64_t logits_budget =
      DefaultChunkBudget(bt, v, DType::kBF16, gemm_workspace_bytes, min_rows);
  const RefExpLayout none = RefExpLayoutOf(0, h, v);
  return logits_budget + none.bytes + (rows + kRefExpTileM) * RefExpRowBytes(h, v);
}

GradScales ComputeGradScales(const LossOptions& o, const TargetSummary& s) {
  GradScales g;
  // The class weights multiply the stored gradient (cw_t (p - [j == t]), smoothing's cw_j):
  // their largest magnitude goes into the GEMMs' alpha with the rest, so that an fp16 G keeps
  // its precision whatever their scale. Weights normalised to sum to 1 over the vocabulary
  // (1e-6 each) had left G below fp16's smallest values (cuda_backend_test's
  // mean_tiny_weights_smooth case: dX and dW off by far more than fp16 rounding).
  const double cw = ClassWeightScale(s.class_weight_max_abs, o.z_loss_scale);
  if (o.reduction == Reduction::kNone) {
    // The per-row upstream gradient carries the scale; its largest magnitude, as a power of
    // two, leaves the stored gradient for the GEMMs' alpha too.
    const double scale = 1.0 / PowerOfTwoAbove(s.row_grad_max_abs);
    g.ce = g.z = static_cast<float>(scale / cw);
    g.alpha = static_cast<float>(cw / scale);
    return g;
  }
  double ce = o.grad_scale, z = o.grad_scale;
  if (o.reduction == Reduction::kMean) {
    ce = s.weight_sum != 0 ? o.grad_scale / s.weight_sum : 0.0;
    z = s.tokens != 0 ? o.grad_scale / static_cast<double>(s.tokens) : 0.0;
  }
  const double alpha = ((ce != 0 && std::isfinite(ce)) ? ce : 1.0) * cw;
  g.alpha = static_cast<float>(alpha);
  g.ce = static_cast<float>(ce / alpha);
  g.z = static_cast<float>(z / alpha);
  return g;
}
int64_t RowSplit(int64_t rows) { return rows >= 512 ? (rows / 2 + 63) / 64 * 64 : rows; }

VocabBlock WholeBlock(const ChunkPlan& plan, int64_t v, int b) {
  const int64_t first = v - (plan.blocks - 1) * plan.block_cols;
  VocabBlock block;
  block.col0 = b == 0 ? 0 : first + (b - 1) * plan.block_cols;
  block.cols = b == 0 ? first : plan.block_cols;
  return block;
}

ChunkPlan PlanWhole(int64_t bt, int64_t h, int64_t v, DType dtype, bool want_dx, DType dx_dtype,
                    uint64_t budget_bytes, uint64_t gemm_workspace_bytes) {
  ChunkPlan plan;  // blocks == 0: the layout does not apply
  const uint64_t elem = DTypeSize(dtype);
  if (bt <= 0 || h <= 0 || v <= 0 || h % 64 != 0 ||
      static_cast<uint64_t>(bt) * elem > 4 * static_cast<uint64_t>(h)) {
    return plan;
  }
  const uint64_t gws = RoundUp(gemm_workspace_bytes, kAlign);
  const uint64_t dx_acc =
      want_dx && dx_dtype != DType::kF32 ? RoundUp(static_cast<uint64_t>(bt) * h * 4, kAlign) : 0;
  const uint64_t fixed = 2 * gws + dx_acc + kAlign;
  if (budget_bytes <= fixed) return plan;
  const int64_t max_cols =
      static_cast<int64_t>((budget_bytes - fixed) / (static_cast<uint64_t>(bt) * elem)) / 64 * 64;
  if (max_cols < 64) return plan;
  const int64_t n0 = (v + max_cols - 1) / max_cols;
  // Equal blocks of a multiple of 64 columns where they can be; block 0 takes the rest.
  const int64_t nb = std::min<int64_t>(max_cols, ((v + n0 - 1) / n0 + 63) / 64 * 64);
  const int64_t n = (v + nb - 1) / nb;
  if (n > kMaxSegments) return plan;
  plan.chunk_rows = bt;
  plan.blocks = static_cast<int32_t>(n);
  plan.block_cols = nb;
  plan.gemm_workspace_bytes = gws;
  plan.workspace_bytes = RoundUp(static_cast<uint64_t>(bt) * nb * elem, kAlign) + dx_acc + 2 * gws;
  return plan;
}

}  // namespace cuda
}  // namespace lossd
