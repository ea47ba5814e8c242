// SPDX-License-Identifier: Apache-2.0
// Chunk planning for the GPU engine: how many rows a chunk holds within a device-memory
// budget, the whole-batch layout where it fits, where a chunk splits into row halves, and the
// gradient's scales. Host arithmetic only: it never touches the GPU, never allocates device
// memory and never reads a tensor.
#ifndef LOSSD_KERNELS_CUDA_CHUNK_PLAN_H_
#define LOSSD_KERNELS_CUDA_CHUNK_PLAN_H_

#include <cstdint>

#include "core/dtype.h"
#include "core/loss_problem.h"
#include "kernels/backend.h"
#include "kernels/cuda/ref_exp_gemm.h"  // the GEMM's CTA tile

namespace lossd {
namespace cuda {

// Host-side facts about the targets that the mean reduction needs before any gradient row.
struct TargetSummary {
  int64_t tokens = 0;           // non-ignored rows
  double weight_sum = 0;        // sum of cw[t_i] over non-ignored rows (tokens without weights)
  double class_weight_sum = 0;  // sum_j cw_j (V without weights)
  // max_j |cw_j| (0 without weights): the class weights scale the stored gradient, so this
  // is taken out of it as a power of two too (see ComputeGradScales).
  double class_weight_max_abs = 0;
  // max_i |row_grad_i| for reduction none with an upstream gradient (0 otherwise): taken out
  // of the stored gradient as a power of two, so small upstream gradients do not underflow fp16.
  double row_grad_max_abs = 0;
};

// How one chunk's work is spread over the three streams. Both are deterministic (each GEMM
// and kernel sees the same inputs whatever overlaps it); they differ in what overlaps what.
enum class Schedule : int32_t {
  // The logits GEMM and the CE kernel in two row halves (the first half's CE runs under the
  // second half's GEMM); dX and dW whole-chunk on two streams, side by side.
  kRowHalves = 0,
  // The logits GEMM and the dW GEMM in two column (vocabulary) halves: the next chunk's
  // first-half logits GEMM (compute-bound) runs under this chunk's second-half dW GEMM, whose
  // fp32 accumulator read and write are memory-bound; dX runs under the first-half dW.
  kColumnHalves = 1,
};

// What the backend uses unless told otherwise: with autotuned GEMMs, row halves measured
// faster at three of the four benchmark shapes with BT >= 8192 (bench/RESULTS.md).
inline constexpr Schedule kDefaultSchedule = Schedule::kRowHalves;
inline constexpr int32_t kDefaultSideSms = 0;

struct ChunkPlan {
  int64_t chunk_rows = 0;  // C
  Schedule schedule = Schedule::kRowHalves;
  // Column halves only: > 0 asks cuBLASLt to size the dW GEMMs for this many SMs and the main
  // stream's GEMMs that run beside them for the rest, so that the two really run side by side
  // (a hint to cuBLASLt's heuristics, not a hard partition). 0: every GEMM sized for the GPU.
  int32_t side_sms = 0;
  // cuBLASLt workspace per stream (two streams run GEMMs side by side); part of the budget.
  uint64_t gemm_workspace_bytes = 0;
  uint64_t workspace_bytes = 0;  // device bytes Enqueue needs as `workspace`
  // Whole-batch layout (PlanWhole) when blocks > 0: no row chunks (chunk_rows = BT); the
  // logits of all rows live in the fp32 dW buffer, split into `blocks` vocabulary blocks
  // (block 0 takes what is left over; the others `block_cols` columns each).
  int32_t blocks = 0;
  int64_t block_cols = 0;
  // Row chunks through the reference-exp path (fused_loss_ref_exp.cc) where the problem's
  // options allow it: the workspace also holds RefExpLayoutOf(chunk_rows, h, v) after the two
  // GEMM workspaces (PlanRefExpChunks).
  bool ref_exp = false;
};

// Bytes of cuBLASLt workspace per stream unless the plan says otherwise.
inline constexpr uint64_t kGemmWorkspaceBytes = 4ull << 20;
// Default budget for the chunk buffer plus GEMM workspaces.
inline constexpr uint64_t kDefaultChunkBudgetBytes = 512ull << 20;
// Wide vocabularies: the default budget grows to hold this many rows of logits (or all of BT),
// up to kMaxDefaultChunkBudgetBytes.
inline constexpr int64_t kMinDefaultChunkRows = 2048;
// The rows an H100's default budget holds (device_tuning.h: measured fastest there).
inline constexpr int64_t kH100DefaultChunkRows = 4096;
inline constexpr uint64_t kMaxDefaultChunkBudgetBytes = 2048ull << 20;

// The budget the backend plans with when none is given: kDefaultChunkBudgetBytes, or where
// that holds fewer than kMinDefaultChunkRows rows of logits (V above about 128K for 16-bit
// logits), enough for min(BT, min_rows) rows, at most kMaxDefaultChunkBudgetBytes. `min_rows`
// is kMinDefaultChunkRows unless the device's tuning says otherwise (device_tuning.h).
// Why rows and not bytes: every chunk after the first reads and writes back the fp32 dW
// (8 V H bytes against the chunk's 6 C V H flops), so the share of that traffic depends on C
// alone, whatever V is; at (8192, 2304, 256000) 1024-row chunks measured 5-6% slower than
// 2048-row ones (bench/RESULTS.md).
uint64_t DefaultChunkBudget(int64_t bt, int64_t v, DType dtype,
                            uint64_t gemm_workspace_bytes = kGemmWorkspaceBytes,
                            int64_t min_rows = kMinDefaultChunkRows);

// The largest chunk whose C x V logits buffer (input dtype) and GEMM workspaces fit in
// `budget_bytes`, balanced so the chunks are of equal size (a multiple of 64 rows where it
// can be). `requested_rows` > 0 overrides the budget. Never returns fewer than 1 row.
// `gemm_workspace_bytes` is the cuBLASLt workspace per stream (two of them are in the budget).
ChunkPlan PlanChunks(int64_t bt, int64_t v, DType dtype, uint64_t budget_bytes,
                     int64_t requested_rows, Schedule schedule = Schedule::kRowHalves,
                     uint64_t gemm_workspace_bytes = kGemmWorkspaceBytes);

// The reference-exp path's buffers for chunks of c rows, as byte offsets after the chunk buffer
// and the two GEMM workspaces (each 256-byte aligned): the GEMM's per-(row, column tile) sums,
// maxima and their columns (ld = c rounded up to the CTA tile), the rows' reference, target
// logit and gradient factor, the sample's logits, the sampled rows of W, diag(factor) X (bf16),
// the fp32 dX chunk, the count of flagged rows and the CUTLASS kernel's workspace.
struct RefExpLayout {
  int64_t ld = 0, n_tiles = 0, n_sample = 0;
  uint64_t tile_sum = 0, tile_max = 0, tile_arg = 0, ref = 0, zt = 0, factor = 0, zs = 0,
           w_sample = 0, xs = 0, dx32 = 0, bad = 0, gemm = 0;
  // The per-row redo of flagged rows (fused_loss_ref_exp.cc): each row's flag and largest
  // logit, the flagged rows' list and references, and one batch of kRefExpRedoRows rows' X,
  // E and tile statistics (leading dimension kRefExpTileM).
  uint64_t row_bad = 0, row_max = 0, redo_idx = 0, redo_ref = 0, redo_x = 0, redo_e = 0,
           redo_sum = 0, redo_max = 0, redo_arg = 0;
  uint64_t bytes = 0;  // all of it
};
// Vocabulary rows the reference's sample takes (evenly strided), at most V.
inline constexpr int64_t kRefExpSample = 1024;
// Flagged rows (a logit more than ~88 above the row's reference) are recomputed in batches of
// kRefExpRedoRows with their own largest logit as the reference, up to kRefExpRedoMax rows a
// chunk; a chunk with more, or with a row of non-finite logits, is redone whole by the
// cross-entropy kernel.
inline constexpr int64_t kRefExpRedoRows = 32;
inline constexpr int64_t kRefExpRedoMax = 256;
// The CUTLASS kernel's workspace (its persistent scheduler needs none today; checked at Enqueue).
inline constexpr uint64_t kRefExpGemmWorkspaceBytes = 1ull << 20;
RefExpLayout RefExpLayoutOf(int64_t c, int64_t h, int64_t v);
// The statistics' leading dimension for a chunk of `rows` rows: rows rounded up to the GEMM's
// CTA tile (RefExpGemmArgs::ld).
int64_t RefExpLd(int64_t rows);

// Whether a problem of this shape is planned for the reference-exp path (where the engine has
// it): bf16 cross-entropy with no bias (nor its gradient), H and V multiples of 8 (the GEMM's
// 16-byte rows), gradients in bf16 or fp32. Options the shape does not carry (a softcap, label
// smoothing) are checked at Enqueue, which takes the other path in the same workspace.
bool RefExpPlannable(const WorkspaceShape& s);

// PlanChunks for the reference-exp path: the chunk buffer and RefExpLayoutOf's per-row buffers
// share the budget (at V = 256000, H = 2304 they add about 8% a row), with the row halves
// schedule for the chunks that fall back to the cross-entropy kernel.
ChunkPlan PlanRefExpChunks(int64_t bt, int64_t h, int64_t v, uint64_t budget_bytes,
                           int64_t requested_rows,
                           uint64_t gemm_workspace_bytes = kGemmWorkspaceBytes);
// DefaultChunkBudget for the reference-exp path: the same rows of logits, plus their share of
// RefExpLayoutOf, so the path plans the same chunk as the default one.
uint64_t DefaultRefExpBudget(int64_t bt, int64_t h, int64_t v,
                             uint64_t gemm_workspace_bytes = kGemmWorkspaceBytes,
                             int64_t min_rows = kMinDefaultChunkRows);

// The whole-batch layout, for a fresh dW (not added into an accumulator) where it fits:
// the logits of every row, in vocabulary blocks, live in the fp32 dW buffer itself, block b
// in the dW rows of block b + 1 (the last block in the workspace), so that dW_b = X^T G_b is
// one GEMM over all BT rows, written over the rows that held block b - 1 (already used). No
// fp32 accumulator is read back; dX is summed over the blocks in an fp32 buffer. Applies when
// a block of BT rows fits in the dW rows of the same width (BT * elem <= 4 H), H % 64 == 0,
// and the last block, the fp32 dX (unless dX is already fp32) and the two GEMM workspaces fit
// in `budget_bytes` with at most kMaxSegments blocks. Otherwise returns blocks == 0 (use
// PlanChunks).
ChunkPlan PlanWhole(int64_t bt, int64_t h, int64_t v, DType dtype, bool want_dx, DType dx_dtype,
                    uint64_t budget_bytes, uint64_t gemm_workspace_bytes = kGemmWorkspaceBytes);

// Block b (0 <= b < plan.blocks) of a whole-batch plan over V columns: columns
// [col0, col0 + cols). Block 0 takes what is left over; the others plan.block_cols each.
struct VocabBlock {
  int64_t col0 = 0, cols = 0;
};
VocabBlock WholeBlock(const ChunkPlan& plan, int64_t v, int b);

// Where a batch of `rows` rows splits into the two row halves whose CE runs under the other
// half's GEMMs; `rows` itself (no split) below a few hundred rows, where the GEMMs would lose
// more than the overlap gains.
int64_t RowSplit(int64_t rows);

// Gradient multipliers of one problem: the kernel's ce/z scales and the GEMMs' alpha. The
// common factor alpha is taken out of the stored gradient so fp16 gradients do not underflow:
// grad_scale / N for the mean, and for reduction none the power of two at or above the largest
// upstream |row_grad| (a power of two, so bf16 and fp32 results are unchanged by it).
struct GradScales {
  float ce = 1, z = 1, alpha = 1;
};
GradScales ComputeGradScales(const LossOptions& o, const TargetSummary& s);

}  // namespace cuda
}  // namespace lossd

#endif  // LOSSD_KERNELS_CUDA_CHUNK_PLAN_H_
