// SPDX-License-Identifier: Apache-2.0
// The whole-batch path of FusedLoss::Enqueue (ChunkPlan::blocks > 0): the logits of every row,
// in vocabulary blocks, live in the fp32 dW buffer itself (chunk_plan.h, PlanWhole); the two
// row halves' logits GEMMs, CE kernels and dX GEMMs, then one dW GEMM per block over all rows.
#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "core/status_macros.h"
#include "kernels/cuda/ce_kernels.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/fused_loss.h"
#include "kernels/cuda/fused_loss_internal.h"

namespace lossd {
namespace cuda {

// What the steps of one whole-batch Enqueue share: the block layout (where each block's G and
// dW rows live), the workspace's parts, the row halves, and the three kinds of GEMM.
class FusedLoss::WholePass {
 public:
  WholePass(FusedLoss& f, const DeviceLossArgs& a, const ChunkPlan& plan, void* workspace);

  // Z_b[r0:r0+rows] = X[r0:r0+rows] W_b^T, stored (rows, cols_b) row-major in block b.
  absl::Status LogitsGemm(int b, int64_t r0, int64_t rows);
  // dX[r0:r0+rows] (+)= G_b[r0:r0+rows] W_b into fp32, blocks added in increasing order.
  absl::Status DxGemm(int b, int64_t r0, int64_t rows);
  // dW_b^T (H x cols_b) = X^T G_b over all BT rows: one GEMM, written over block b - 1's G.
  absl::Status DwGemm(int b);

  FusedLoss& f;
  const DeviceLossArgs& a;
  int64_t bt, h, v;
  size_t elem;
  int n;       // blocks
  int64_t nb;  // columns of every block but block 0
  cudaDataType ab;
  GradScales scales;
  bool want_dx, want_db, dx_direct;
  uint64_t gws;
  char* last;              // the last block's G, in the workspace
  float* dx_sum = nullptr;  // (BT, H) fp32 dX sum: dX itself when it is fp32, else workspace
  void* ws_main;
  // Block b: columns [col0[b], col0[b] + cols[b]); its dW rows (region) and where its G lives:
  // the region of block b + 1, or the workspace for the last block.
  int64_t col0[kMaxSegments], cols[kMaxSegments];
  float* region[kMaxSegments];
  char* gbase[kMaxSegments];
  int32_t rank_logits, rank_dx, rank_dw;
  bool gemm_bias;  // as in the row-chunk path
  int halves;
  int64_t hbegin[2], hcount[2];
  bool tuning = false;  // see ChunkPass::tuning
};

FusedLoss::WholePass::WholePass(FusedLoss& f, const DeviceLossArgs& a, const ChunkPlan& plan,
                                void* workspace)
    : f(f), a(a), bt(a.bt), h(a.h), v(a.v) {
  elem = DTypeSize(a.dtype);
  n = plan.blocks;
  nb = plan.block_cols;
  ab = CudaType(a.dtype);
  scales = ComputeGradScales(a.options, a.summary);
  want_dx = a.dx != nullptr;
  want_db = a.db_acc != nullptr;
  dx_direct = want_dx && a.dx_dtype == DType::kF32;
  gws = plan.gemm_workspace_bytes;

  // Workspace: the last block of G, the fp32 dX sum (unless dX is fp32 itself), two GEMM
  // workspaces.
  last = static_cast<char*>(workspace);
  char* next = last + RoundUp(static_cast<uint64_t>(bt) * nb * elem, kAlign);
  if (want_dx) {
    if (dx_direct) {
      dx_sum = static_cast<float*>(a.dx);
    } else {
      dx_sum = reinterpret_cast<float*>(next);
      next += RoundUp(static_cast<uint64_t>(bt) * h * 4, kAlign);
    }
  }
  ws_main = next;
  for (int b = 0; b < n; ++b) {
    const VocabBlock block = WholeBlock(plan, v, b);
    col0[b] = block.col0;
    cols[b] = block.cols;
    region[b] = a.dw_acc + col0[b] * h;
  }
  for (int b = 0; b < n; ++b) {
    gbase[b] = b + 1 < n ? reinterpret_cast<char*>(region[b + 1]) : last;
  }
  rank_logits = f.algo_ranks_[static_cast<int>(GemmRole::kLogits)];
  rank_dx = f.algo_ranks_[static_cast<int>(GemmRole::kDx)];
  rank_dw = f.algo_ranks_[static_cast<int>(GemmRole::kDw)];
  gemm_bias = BiasInGemm(a.bias, elem, col0, n);
  const int64_t split = RowSplit(bt);
  halves = split < bt ? 2 : 1;
  hbegin[0] = 0;
  hbegin[1] = split;
  hcount[0] = split;
  hcount[1] = bt - split;
}

absl::Status FusedLoss::WholePass::LogitsGemm(int b, int64_t r0, int64_t rows) {
  const Spec g{/*trans_a=*/true,
               /*trans_b=*/false,
               cols[b],
               rows,
               h,
               Offset(a.w, col0[b] * h, elem),
               h,
               Offset(a.x, r0 * h, elem),
               h,
               ab,
               /*beta=*/0.0f,
               gbase[b] + r0 * cols[b] * elem,
               cols[b],
               ab,
               gws,
               /*sm_target=*/0,
               gemm_bias ? Offset(a.bias, col0[b], elem) : nullptr};
  return f.RunOrTune(tuning, f.main_, ws_main, 1.0f, g, rank_logits);
}

absl::Status FusedLoss::WholePass::DxGemm(int b, int64_t r0, int64_t rows) {
  if (!want_dx) return absl::OkStatus();
  const Spec g{/*trans_a=*/false,
               /*trans_b=*/false,
               h,
               rows,
               cols[b],
               Offset(a.w, col0[b] * h, elem),
               h,
               gbase[b] + r0 * cols[b] * elem,
               cols[b],
               ab,
               /*beta=*/b > 0 ? 1.0f : 0.0f,
               dx_sum + r0 * h,
               h,
               CUDA_R_32F,
               gws,
               /*sm_target=*/0,
               /*bias=*/nullptr};
  return f.RunOrTune(tuning, f.main_, ws_main, scales.alpha, g, rank_dx);
}

absl::Status FusedLoss::WholePass::DwGemm(int b) {
  const Spec g{/*trans_a=*/false,
               /*trans_b=*/true,
               h,
               cols[b],
               bt,
               a.x,
               h,
               gbase[b],
               cols[b],
               ab,
               /*beta=*/0.0f,
               region[b],
               h,
               CUDA_R_32F,
               gws,
               /*sm_target=*/0,
               /*bias=*/nullptr};
  return f.RunOrTune(tuning, f.main_, ws_main, scales.alpha, g, rank_dw);
}

// Tuning pass (as in the row-chunk path): every GEMM below timed once per shape on these very
// buffers before any real work; nothing they write is read before the real GEMMs rewrite it.
absl::Status FusedLoss::TuneWhole(WholePass& w) {
  const int n = w.n;
  w.tuning = true;
  for (int s = 0; s < w.halves; ++s) {
    for (int b = 0; b < n; ++b) {
      LOSSD_RETURN_IF_ERROR(w.LogitsGemm(b, w.hbegin[s], w.hcount[s]));
    }
  }
  for (int s = 0; s < w.halves; ++s) {
    for (int b = 0; b < n; ++b) LOSSD_RETURN_IF_ERROR(w.DxGemm(b, w.hbegin[s], w.hcount[s]));
  }
  for (int b = 0; b < n; ++b) LOSSD_RETURN_IF_ERROR(w.DwGemm(b));
  w.tuning = false;
  return absl::OkStatus();
}

// Each row half's CE kernel on ce_, over the blocked layout, after that half's logits GEMMs.
absl::Status FusedLoss::WholeCrossEntropy(WholePass& w) {
  const int n = w.n;
  const size_t elem = w.elem;
  for (int s = 0; s < w.halves; ++s) {
    LOSSD_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(ce_, logits_done_[s], 0));
    CrossEntropyParams p =
        RowParams(w.a, w.scales, /*write_grad=*/true, w.hbegin[s], w.hcount[s]);
    if (w.gemm_bias) p.bias = nullptr;  // already in the stored logits
    p.logits = nullptr;
    p.segments = n;
    for (int b = 0; b < n; ++b) {
      p.seg_base[b] = w.gbase[b] + w.hbegin[s] * w.cols[b] * elem;
      p.seg_col0[b] = w.col0[b];
      p.seg_cols[b] = w.cols[b];
    }
    LOSSD_CUDA_RETURN_IF_ERROR(LaunchCrossEntropy(p, ce_));
    LOSSD_CUDA_RETURN_IF_ERROR(cudaEventRecord(ce_done_[s], ce_));
  }
  return absl::OkStatus();
}

absl::Status FusedLoss::EnqueueWhole(const DeviceLossArgs& a, const ChunkPlan& plan,
                                     void* workspace) {
  const int64_t bt = a.bt, h = a.h, v = a.v;
  const size_t elem = DTypeSize(a.dtype);
  const int n = plan.blocks;
  const int64_t nb = plan.block_cols;
  if (a.dw_acc == nullptr || a.accumulate_dw) {
    return absl::InvalidArgumentError(
        "cuda: the whole-batch layout needs a fresh dW (no accumulation into it)");
  }
  if (n > kMaxSegments || nb <= 0 || (n - 1) * nb >= v || n * nb < v || bt <= 0 ||
      static_cast<uint64_t>(bt) * elem > 4 * static_cast<uint64_t>(h) || h % 64 != 0 ||
      plan.chunk_rows != bt) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cuda: whole-batch plan (", n, " blocks of ", nb, " columns) does not fit bt=", bt,
        " h=", h, " v=", v));
  }
  WholePass w(*this, a, plan, workspace);
  if (autotune_) LOSSD_RETURN_IF_ERROR(TuneWhole(w));
  // The names the steps below are written in.
  float* const dx_sum = w.dx_sum;
  char* const* gbase = w.gbase;
  const int64_t* cols = w.cols;
  const int64_t* col0 = w.col0;
  const GradScales& scales = w.scales;

  LOSSD_CUDA_RETURN_IF_ERROR(cudaEventRecord(start_, main_));
  LOSSD_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(ce_, start_, 0));
  if (w.want_db && !a.accumulate_db) {
    LOSSD_CUDA_RETURN_IF_ERROR(
        cudaMemsetAsync(a.db_acc, 0, static_cast<size_t>(v) * sizeof(float), main_));
  }
  // Logits of both row halves; the first half's CE runs under the second half's GEMMs, and the
  // second half's CE under the first half's dX GEMMs.
  for (int s = 0; s < w.halves; ++s) {
    for (int b = 0; b < n; ++b) {
      LOSSD_RETURN_IF_ERROR(w.LogitsGemm(b, w.hbegin[s], w.hcount[s]));
    }
    LOSSD_CUDA_RETURN_IF_ERROR(cudaEventRecord(logits_done_[s], main_));
  }
  LOSSD_RETURN_IF_ERROR(WholeCrossEntropy(w));
  for (int s = 0; s < w.halves; ++s) {
    LOSSD_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(main_, ce_done_[s], 0));
    for (int b = 0; b < n; ++b) LOSSD_RETURN_IF_ERROR(w.DxGemm(b, w.hbegin[s], w.hcount[s]));
  }
  if (w.want_dx && !w.dx_direct) {
    LOSSD_CUDA_RETURN_IF_ERROR(LaunchCastFromFloat(dx_sum, a.dx, static_cast<int32_t>(a.dx_dtype),
                                                   bt * h, main_));
  }
  // db reads every block of G; block b's G is overwritten by dW_{b+1}.
  if (w.want_db) {
    for (int b = 0; b < n; ++b) {
      LOSSD_CUDA_RETURN_IF_ERROR(LaunchColumnSumAccumulate(gbase[b], static_cast<int32_t>(a.dtype),
                                                           bt, cols[b], scales.alpha,
                                                           a.db_acc + col0[b], main_));
    }
  }
  for (int b = 0; b < n; ++b) LOSSD_RETURN_IF_ERROR(w.DwGemm(b));
  LOSSD_CUDA_RETURN_IF_ERROR(cudaEventRecord(ce_end_, ce_));
  LOSSD_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(main_, ce_end_, 0));
  return absl::OkStatus();
}

}  // namespace cuda
}  // namespace lossd
