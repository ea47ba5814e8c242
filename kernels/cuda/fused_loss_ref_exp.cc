// SPDX-License-Identifier: Apache-2.0
// The reference-exp path of FusedLoss::Enqueue (a plan with ChunkPlan::ref_exp, a problem
// RefExpCovers): a backward with no pass over the logits. Per chunk of C rows, on main_:
//   zt  = each row's target logit (a dot product a row), zs = its logits at kRefExpSample evenly
//         strided vocabulary rows (one C x 1024 GEMM), ref = max(zt, max zs): a logit of the row;
//   E   = exp(X_c W^T - ref) in bf16, straight from the fp32 accumulator, with per-tile sums,
//         maxima and their columns in the GEMM's epilogue (ref_exp_gemm.h);
//   the combine (ref_exp_kernels.h): S = the row's sum, lse = ref + log S, the row's loss and
//         prediction, factor f = a / S and E[t] <- E[t] - (hot / a) S, so that diag(f) E' is
//         the cross-entropy kernel's gradient G exactly (g_j = a p_j - hot [j == t]);
//   dX_c = diag(f) (E' W) (the GEMM into fp32, then one rounding) on main_ and, beside it on
//   side_, dW += E'^T (diag(f) X_c): plain cuBLASLt GEMMs; the next chunk's GEMM waits for
//   this dW before it rewrites E.
// What is left of the cross-entropy pass (1.3-2.5 ms a call at V = 256000 on an H200) is
// C-sized work. A row whose largest logit sits more than ~88 above its reference overflows E;
// the combine flags such rows, LaunchCompactFlagged lists them, and the host reads the counts
// (while the chunk's dX GEMM runs) before it adds the chunk's dW: the flagged rows alone are
// recomputed with their own largest logit as the reference (RefExpRedoRows) and the chunk's dX
// redone; a chunk with more than kRefExpRedoMax of them, or a row of non-finite logits, is
// redone whole by RowChunk, whose results replace the chunk's. A caller sees the same outputs
// either way up to rounding.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "core/dtype.h"
#include "core/loss_problem.h"
#include "core/status_macros.h"
#include "kernels/cuda/ce_kernels.h"
#include "kernels/cuda/chunk_plan.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/fused_loss.h"
#include "kernels/cuda/fused_loss_internal.h"
#include "kernels/cuda/ref_exp_gemm.h"
#include "kernels/cuda/ref_exp_kernels.h"

namespace lossd {
namespace cuda {

// The row-chunk pass (its buffers, scales and fallback) and the path's own buffers, laid out
// after the two GEMM workspaces (RefExpLayoutOf).
class FusedLoss::RefExpPass {
 public:
  RefExpPass(FusedLoss& f, const DeviceLossArgs& a, const ChunkPlan& plan, void* workspace)
      : c(f, a, plan, workspace), l(RefExpLayoutOf(plan.chunk_rows, a.h, a.v)) {
    l.n_sample = std::clamp<int64_t>(f.ref_exp_sample_, 1, l.n_sample);
    base = static_cast<char*>(c.ws_side) + c.gws;
    tile_sum = reinterpret_cast<float*>(base + l.tile_sum);
    tile_max = reinterpret_cast<float*>(base + l.tile_max);
    tile_arg = reinterpret_cast<int32_t*>(base + l.tile_arg);
    ref = reinterpret_cast<float*>(base + l.ref);
    zt = reinterpret_cast<float*>(base + l.zt);
    factor = reinterpret_cast<float*>(base + l.factor);
    zs = reinterpret_cast<float*>(base + l.zs);
    w_sample = base + l.w_sample;
    xs = base + l.xs;
    dx32 = reinterpret_cast<float*>(base + l.dx32);
    flagged = reinterpret_cast<unsigned int*>(base + l.bad);
    gemm_ws = base + l.gemm;
    row_bad = reinterpret_cast<int32_t*>(base + l.row_bad);
    row_max = reinterpret_cast<float*>(base + l.row_max);
    redo_idx = reinterpret_cast<int32_t*>(base + l.redo_idx);
    redo_ref = reinterpret_cast<float*>(base + l.redo_ref);
    redo_x = base + l.redo_x;
    redo_e = base + l.redo_e;
    redo_sum = reinterpret_cast<float*>(base + l.redo_sum);
    redo_max = reinterpret_cast<float*>(base + l.redo_max);
    redo_arg = reinterpret_cast<int32_t*>(base + l.redo_arg);
  }

  // zs^T (n_sample x rows) = W_sample * X_c^T, fp32 out.
  Spec SampleSpec(int64_t c0, int64_t rows) const {
    const DeviceLossArgs& a = c.a;
    return Spec{true, false, l.n_sample, rows, a.h, w_sample, a.h, Offset(a.x, c0 * a.h, 2),
                a.h, c.ab, 0.0f, zs, l.n_sample, CUDA_R_32F, c.gws, 0, nullptr};
  }
  // dX32_c^T (H x rows) = W (H x V col-major) * E'^T (V x rows col-major), fp32 out.
  Spec DxSpec(int64_t rows) const {
    const DeviceLossArgs& a = c.a;
    return Spec{false, false, a.h, rows, a.v, a.w, a.h, c.logits, a.v, c.ab, 0.0f, dx32, a.h,
                CUDA_R_32F, c.gws, 0, nullptr};
  }
  // dW^T (H x V) (+)= (diag(f) X_c)^T (H x rows col-major) * E' (rows x V).
  Spec DwSpec(int64_t c0, int64_t rows) const {
    const DeviceLossArgs& a = c.a;
    const float beta = (a.accumulate_dw || c0 > 0) ? 1.0f : 0.0f;
    return Spec{false, true, a.h, a.v, rows, xs, a.h, c.logits, a.v, c.ab, beta, a.dw_acc, a.h,
                CUDA_R_32F, c.gws, 0, nullptr};
  }

  // The combine's parameters for the chunk (the forward's and the redo's).
  RefExpCombineParams Combine(int64_t c0, int64_t rows) const {
    RefExpCombineParams p;
    p.ce = RowParams(c.a, c.scales, /*write_grad=*/true, c0, rows);
    p.tile_sum = tile_sum;
    p.tile_max = tile_max;
    p.tile_arg = tile_arg;
    p.n_tiles = l.n_tiles;
    p.ld = RefExpLd(rows);
    p.zt = zt;
    p.ref = ref;
    p.e = c.logits;
    p.factor = factor;
    p.bad = flagged;
    return p;
  }

  ChunkPass c;
  RefExpLayout l;
  char* base;
  float *tile_sum, *tile_max;
  int32_t* tile_arg;
  float *ref, *zt, *factor, *zs;
  void* w_sample;
  void* xs;
  float* dx32;
  unsigned int* flagged;  // [0] the combine's count, [1] and [2] LaunchCompactFlagged's
  void* gemm_ws;
  int32_t *row_bad, *redo_idx;
  float *row_max, *redo_ref;
  void *redo_x, *redo_e;
  float *redo_sum, *redo_max;
  int32_t* redo_arg;
  // A chunk's dW (or a fallen-back chunk's dW/db) on side_ still reads the buffer: the next
  // chunk's GEMM waits for dw_done_[0].
  bool dw_pending = false;
};

bool FusedLoss::RefExpCovers(const DeviceLossArgs& a) {
  auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  return a.kind == LossKind::kCrossEntropy && a.dtype == DType::kBF16 && a.bias == nullptr &&
         a.db_acc == nullptr && a.options.softcap == 0.0f && a.options.label_smoothing == 0.0f &&
         a.h % 8 == 0 && a.v % 8 == 0 && a.h <= 0x7fffffff && aligned(a.x) && aligned(a.w) &&
         (a.dx == nullptr || a.dx_dtype == DType::kBF16 || a.dx_dtype == DType::kF32);
}

// Tuning pass of the path's own GEMMs (the sample's and the fp32 dX; the dW with diag(f) X),
// on the real buffers before any real work; the dW trials run over a zeroed chunk buffer, so
// an accumulator is left as it was (as TuneChunks does).
absl::Status FusedLoss::TuneRefExp(RefExpPass& r) {
  const DeviceLossArgs& a = r.c.a;
  LOSSD_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(
      r.c.logits, 0, static_cast<size_t>(r.c.plan.chunk_rows) * a.v * 2, main_));
  for (int64_t c0 = 0; c0 < a.bt; c0 += r.c.plan.chunk_rows) {
    const int64_t rows = std::min(r.c.plan.chunk_rows, a.bt - c0);
    LOSSD_RETURN_IF_ERROR(RunOrTune(true, main_, r.c.ws_main, 1.0f, r.SampleSpec(c0, rows), 0));
    if (a.dx != nullptr) {
      LOSSD_RETURN_IF_ERROR(
          RunOrTune(true, main_, r.c.ws_main, r.c.scales.alpha, r.DxSpec(rows), 0));
    }
    if (r.c.want_dw) {
      LOSSD_RETURN_IF_ERROR(
          RunOrTune(true, main_, r.c.ws_main, r.c.scales.alpha, r.DwSpec(c0, rows), 0));
    }
  }
  return absl::OkStatus();
}

// The chunk's forward on main_: the reference, E and its tile statistics, the combine, and
// the count of flagged rows on its way to flagged_host_ (combined_ says when it is there).
absl::Status FusedLoss::RefExpForward(RefExpPass& r, int64_t c0, int64_t rows) {
  ChunkPass& c = r.c;
  const DeviceLossArgs& a = c.a;
  const void* x = Offset(a.x, c0 * a.h, 2);
  const int64_t ld = RefExpLd(rows);
  LOSSD_RETURN_IF_ERROR(CudaStatus(
      LaunchTargetLogits(x, a.w, a.targets + c0, rows, a.h, r.zt, main_), "LaunchTargetLogits"));
  LOSSD_RETURN_IF_ERROR(RunSpec(main_, c.ws_main, 1.0f, r.SampleSpec(c0, rows), 0));
  LOSSD_RETURN_IF_ERROR(
      CudaStatus(LaunchRowReference(r.zt, r.zs, rows, r.l.n_sample, ld, r.ref, main_),
                 "LaunchRowReference"));
  RefExpGemmArgs g;
  g.x = x;
  g.w = a.w;
  g.e = c.logits;
  g.ref = r.ref;
  g.tile_sum = r.tile_sum;
  g.tile_max = r.tile_max;
  g.tile_arg = r.tile_arg;
  g.ld = ld;
  g.c = rows;
  g.h = a.h;
  g.v = a.v;
  LOSSD_RETURN_IF_ERROR(RunRefExpGemm(g, r.gemm_ws));
  LOSSD_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(r.flagged, 0, sizeof(unsigned int), main_));
  RefExpCombineParams p = r.Combine(c0, rows);
  p.row_bad = r.row_bad;
  p.row_max = r.row_max;
  LOSSD_RETURN_IF_ERROR(CudaStatus(LaunchCombineRefExp(p, main_), "LaunchCombineRefExp"));
  LOSSD_RETURN_IF_ERROR(CudaStatus(
      LaunchCompactFlagged(r.row_bad, r.row_max, rows, r.redo_idx, r.redo_ref,
                           kRefExpRedoMax + kRefExpTileM, r.flagged + 1, main_),
      "LaunchCompactFlagged"));
  LOSSD_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(flagged_host_, r.flagged, 3 * sizeof(unsigned int),
                                             cudaMemcpyDeviceToHost, main_));
  return CudaStatus(cudaEventRecord(combined_, main_), "cudaEventRecord(combined)");
}

absl::Status FusedLoss::RunRefExpGemm(const RefExpGemmArgs& g, void* workspace) {
  if (ref_exp_gemm_->WorkspaceBytes(g) > kRefExpGemmWorkspaceBytes) {
    return absl::InternalError(absl::StrCat("cuda: the reference-exp GEMM wants ",
                                            ref_exp_gemm_->WorkspaceBytes(g),
                                            " bytes of workspace; the plan holds ",
                                            kRefExpGemmWorkspaceBytes));
  }
  if (const std::string err = ref_exp_gemm_->Run(g, workspace, main_); !err.empty()) {
    return absl::InternalError(absl::StrCat("cuda: ", err));
  }
  return absl::OkStatus();
}

// On main_: xs = diag(f) X_c for the dW GEMM (logits_done_[0] says E' and xs are ready), and
// dX_c = diag(f) (E' W) through the fp32 dX chunk.
absl::Status FusedLoss::RefExpScaledDx(RefExpPass& r, int64_t c0, int64_t rows) {
  ChunkPass& c = r.c;
  const DeviceLossArgs& a = c.a;
  if (c.want_dw) {
    LOSSD_RETURN_IF_ERROR(CudaStatus(LaunchScaleRows(Offset(a.x, c0 * a.h, 2), kElemBF16,
                                                     r.factor, rows, a.h, r.xs, kElemBF16, main_),
                                     "LaunchScaleRows(X)"));
    LOSSD_CUDA_RETURN_IF_ERROR(cudaEventRecord(logits_done_[0], main_));
  }
  if (a.dx == nullptr) return absl::OkStatus();
  LOSSD_RETURN_IF_ERROR(RunSpec(main_, c.ws_main, c.scales.alpha, r.DxSpec(rows), 0));
  const size_t dx_elem = DTypeSize(a.dx_dtype);
  return CudaStatus(LaunchScaleRows(r.dx32, kElemF32, r.factor, rows, a.h,
                                    static_cast<char*>(a.dx) + c0 * a.h * dx_elem,
                                    a.dx_dtype == DType::kF32 ? kElemF32 : kElemBF16, main_),
                    "LaunchScaleRows(dX)");
}

// The chunk's `n` flagged rows (redo_idx, redo_ref from LaunchCompactFlagged), on main_ after
// the chunk's first dX: in batches of kRefExpRedoRows, their X rows gathered, the same GEMM
// with the row's largest logit as its reference (exp(z - max) <= 1: nothing overflows), E rows,
// tile statistics and references put back in the chunk's; then the combine over those rows.
// Each row's GEMM is the same K loop whatever its place: reruns are bit-identical.
absl::Status FusedLoss::RefExpRedoRows(RefExpPass& r, int64_t c0, int64_t rows, int64_t n) {
  const DeviceLossArgs& a = r.c.a;
  const void* x = Offset(a.x, c0 * a.h, 2);
  for (int64_t b = 0; b < n; b += kRefExpRedoRows) {
    const int64_t m = std::min(kRefExpRedoRows, n - b);
    LOSSD_RETURN_IF_ERROR(CudaStatus(
        LaunchGatherRows(x, r.redo_idx + b, m, a.h, r.redo_x, main_), "LaunchGatherRows"));
    RefExpGemmArgs g;
    g.x = r.redo_x;
    g.w = a.w;
    g.e = r.redo_e;
    g.ref = r.redo_ref + b;
    g.tile_sum = r.redo_sum;
    g.tile_max = r.redo_max;
    g.tile_arg = r.redo_arg;
    g.ld = RefExpLd(m);
    g.c = m;
    g.h = a.h;
    g.v = a.v;
    LOSSD_RETURN_IF_ERROR(RunRefExpGemm(g, r.gemm_ws));
    RefExpScatter s;
    s.idx = r.redo_idx + b;
    s.n = m;
    s.v = a.v;
    s.n_tiles = r.l.n_tiles;
    s.ld_redo = g.ld;
    s.ld = RefExpLd(rows);
    s.e_redo = r.redo_e;
    s.sum_redo = r.redo_sum;
    s.max_redo = r.redo_max;
    s.arg_redo = r.redo_arg;
    s.ref_redo = r.redo_ref + b;
    s.e = r.c.logits;
    s.tile_sum = r.tile_sum;
    s.tile_max = r.tile_max;
    s.tile_arg = r.tile_arg;
    s.ref = r.ref;
    LOSSD_RETURN_IF_ERROR(CudaStatus(LaunchScatterRedo(s, main_), "LaunchScatterRedo"));
  }
  RefExpCombineParams p = r.Combine(c0, rows);
  p.only_rows = r.redo_idx;
  p.n_only = n;
  return CudaStatus(LaunchCombineRefExp(p, main_), "LaunchCombineRefExp(redo)");
}

absl::Status FusedLoss::RefExpChunk(RefExpPass& r, int64_t c0, int64_t rows) {
  ChunkPass& c = r.c;
  LOSSD_RETURN_IF_ERROR(c.XReady(c0, rows));
  if (r.dw_pending) LOSSD_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(main_, dw_done_[0], 0));
  LOSSD_RETURN_IF_ERROR(RefExpForward(r, c0, rows));
  // The dX GEMM goes in before the host looks at the counts, so the GPU has it to run while
  // the host waits; a flagged chunk's dX is rewritten below.
  LOSSD_RETURN_IF_ERROR(RefExpScaledDx(r, c0, rows));
  ++ref_exp_chunks_;
  LOSSD_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(combined_));
  const unsigned int redo = flagged_host_[1], hopeless = flagged_host_[2];
  if (redo + hopeless != 0) {
    if (hopeless == 0 && redo <= kRefExpRedoMax) {
      // The flagged rows alone, with their own largest logit as the reference; the rest of
      // the chunk is kept. Then the chunk's xs and dX again, over the mended E'.
      LOSSD_RETURN_IF_ERROR(RefExpRedoRows(r, c0, rows, redo));
      ref_exp_redone_rows_ += redo;
      LOSSD_RETURN_IF_ERROR(RefExpScaledDx(r, c0, rows));
    } else {
      ++ref_exp_fallbacks_;
      r.dw_pending = true;
      return RowChunk(c, c0, rows);  // rewrites the chunk's row results, dX rows, adds its dW
    }
  }
  if (c.want_dw) {
    // Beside the dX GEMM: the two read E' and write different outputs.
    LOSSD_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(side_, logits_done_[0], 0));
    LOSSD_RETURN_IF_ERROR(RunSpec(side_, c.ws_side, c.scales.alpha, r.DwSpec(c0, rows), 0));
    LOSSD_CUDA_RETURN_IF_ERROR(cudaEventRecord(dw_done_[0], side_));
    r.dw_pending = true;
  }
  return c.DxEnqueued(c0, rows);
}

absl::Status FusedLoss::EnqueueRefExp(const DeviceLossArgs& a, const ChunkPlan& plan,
                                      void* workspace) {
  RefExpPass r(*this, a, plan, workspace);
  if (autotune_ && a.bt > 0) {
    LOSSD_RETURN_IF_ERROR(TuneChunks(r.c));  // the fallback's GEMMs
    LOSSD_RETURN_IF_ERROR(TuneRefExp(r));
  }
  LOSSD_RETURN_IF_ERROR(StartChunks(r.c));
  // The sample's rows of W: 0, V / n, 2 V / n, ...
  const int64_t step = a.v / r.l.n_sample;
  LOSSD_CUDA_RETURN_IF_ERROR(cudaMemcpy2DAsync(r.w_sample, a.h * 2, a.w, step * a.h * 2, a.h * 2,
                                               r.l.n_sample, cudaMemcpyDeviceToDevice, main_));
  for (int64_t c0 = 0; c0 < a.bt; c0 += plan.chunk_rows) {
    LOSSD_RETURN_IF_ERROR(RefExpChunk(r, c0, std::min(plan.chunk_rows, a.bt - c0)));
  }
  return JoinStreams();  // ce_ has work only where a chunk fell back
}

}  // namespace cuda
}  // namespace lossd
