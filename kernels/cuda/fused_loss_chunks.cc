// SPDX-License-Identifier: Apache-2.0
// The row-chunk path of FusedLoss::Enqueue: per chunk of C rows, the logits GEMM, the
// cross-entropy kernel, the dX GEMM and the dW/db accumulation, spread over main_, ce_ and
// side_ by the plan's schedule (row halves or column halves), after an optional tuning pass.
#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/status_macros.h"
#include "kernels/cuda/ce_kernels.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/fused_loss.h"
#include "kernels/cuda/fused_loss_internal.h"
#include "kernels/cuda/row_loss_kernels.h"

namespace lossd {
namespace cuda {

FusedLoss::ChunkPass::ChunkPass(FusedLoss& f, const DeviceLossArgs& a, const ChunkPlan& plan,
                                void* workspace)
    : f(f), a(a), plan(plan) {
  elem = DTypeSize(a.dtype);
  ab = CudaType(a.dtype);
  scales = ComputeGradScales(a.options, a.summary);
  if (a.kind != LossKind::kCrossEntropy) scales.alpha = a.row_loss.alpha;
  want_dw = a.dw_acc != nullptr;
  want_db = a.db_acc != nullptr;
  write_grad = a.dx != nullptr || want_dw || want_db;

  gws = plan.gemm_workspace_bytes;
  logits = static_cast<char*>(workspace);
  ws_main = logits + RoundUp(static_cast<uint64_t>(plan.chunk_rows) * a.v * elem, kAlign);
  ws_side = static_cast<char*>(ws_main) + gws;
  rank_logits = f.algo_ranks_[static_cast<int>(GemmRole::kLogits)];
  rank_dx = f.algo_ranks_[static_cast<int>(GemmRole::kDx)];
  rank_dw = f.algo_ranks_[static_cast<int>(GemmRole::kDw)];

  columns = plan.schedule == Schedule::kColumnHalves && a.v >= 256;
  const int64_t vsplit = columns ? (a.v / 2 + 63) / 64 * 64 : a.v;
  vbegin[0] = 0;
  vbegin[1] = vsplit;
  vcount[0] = vsplit;
  vcount[1] = a.v - vsplit;
  // The bias goes into the logits GEMM's epilogue (rounded with the logits, as on the CPU)
  // where every logits GEMM's slice of it is 16-byte aligned, which the epilogue needs; else
  // the CE kernel adds it to the stored logits in fp32.
  gemm_bias = BiasInGemm(a.bias, elem, vbegin, columns ? 2 : 1);
  // Distill: the teacher's chunk buffer follows the two GEMM workspaces.
  const bool distill = a.kind == LossKind::kDistill;
  teacher_logits = distill ? static_cast<char*>(ws_side) + gws : nullptr;
  teacher_gemm_bias =
      distill && BiasInGemm(a.row_loss.teacher_bias, elem, vbegin, columns ? 2 : 1);
  // SM targets when the column-halves schedule pairs a main GEMM with a dW GEMM.
  side_sms = plan.side_sms > 0 && plan.side_sms < f.sm_count_ ? plan.side_sms : 0;
  main_sms = side_sms > 0 ? f.sm_count_ - side_sms : 0;
}

// The cross-entropy (or the logprob / policy / distill row kernel) of rows [r0, r0 + n) of
// the chunk starting at c0, on ce_.
absl::Status FusedLoss::ChunkPass::CrossEntropy(int64_t c0, int64_t r0, int64_t n) {
  if (a.kind != LossKind::kCrossEntropy) {
    RowLossParams p = RowLossParamsOf(a, write_grad, c0 + r0, n);
    if (gemm_bias) p.bias = nullptr;  // already in the stored logits
    if (teacher_gemm_bias) p.teacher_bias = nullptr;
    p.logits = logits + r0 * a.v * elem;
    if (teacher_logits != nullptr) p.teacher_logits = teacher_logits + r0 * a.v * elem;
    return CudaStatus(LaunchRowLoss(p, f.ce_), "LaunchRowLoss");
  }
  CrossEntropyParams p = RowParams(a, scales, write_grad, c0 + r0, n);
  if (gemm_bias) p.bias = nullptr;  // already in the stored logits
  p.logits = logits + r0 * a.v * elem;
  return CudaStatus(LaunchCrossEntropy(p, f.ce_), "LaunchCrossEntropy");
}

// z[r0:r0+n, v0:v0+nv] = X_c[r0:r0+n] W[v0:v0+nv]^T (+ b[v0:v0+nv] where the GEMM adds the
// bias), as z^T (nv x n) = W^T-view * X_c^T; for distill the teacher's too.
absl::Status FusedLoss::ChunkPass::LogitsGemm(int64_t c0, int64_t r0, int64_t n, int64_t v0,
                                              int64_t nv, int32_t sms) {
  const Spec g{/*trans_a=*/true,
               /*trans_b=*/false,
               nv,
               n,
               a.h,
               Offset(a.w, v0 * a.h, elem),
               a.h,
               Offset(a.x, (c0 + r0) * a.h, elem),
               a.h,
               ab,
               /*beta=*/0.0f,
               logits + (r0 * a.v + v0) * elem,
               a.v,
               ab,
               gws,
               sms,
               gemm_bias ? Offset(a.bias, v0, elem) : nullptr};
  LOSSD_RETURN_IF_ERROR(Gemm(f.main_, ws_main, 1.0f, g, rank_logits));
  if (teacher_logits == nullptr) return absl::OkStatus();
  // Distill: the teacher's logits of the same rows and columns, on the same stream, so every
  // event after the student's GEMM covers them too.
  const RowLossInputs& t = a.row_loss;
  const Spec tg{/*trans_a=*/true,
                /*trans_b=*/false,
                nv,
                n,
                t.teacher_h,
                Offset(t.teacher_w, v0 * t.teacher_h, elem),
                t.teacher_h,
                Offset(t.teacher_x, (c0 + r0) * t.teacher_h, elem),
                t.teacher_h,
                ab,
                /*beta=*/0.0f,
                teacher_logits + (r0 * a.v + v0) * elem,
                a.v,
                ab,
                gws,
                sms,
                teacher_gemm_bias ? Offset(t.teacher_bias, v0, elem) : nullptr};
  return Gemm(f.main_, ws_main, 1.0f, tg, rank_logits);
}

// dX_c^T (H x C) = W (H x V col-major) * G^T (V x C col-major).
absl::Status FusedLoss::ChunkPass::DxGemm(int64_t c0, int64_t rows, int32_t sms) {
  if (a.dx == nullptr) return absl::OkStatus();
  const size_t dx_elem = DTypeSize(a.dx_dtype);
  char* dx = static_cast<char*>(a.dx) + c0 * a.h * dx_elem;
  const Spec g{/*trans_a=*/false,
               /*trans_b=*/false,
               a.h,
               rows,
               a.v,
               a.w,
               a.h,
               logits,
               a.v,
               ab,
               /*beta=*/0.0f,
               dx,
               a.h,
               CudaType(a.dx_dtype),
               gws,
               sms,
               /*bias=*/nullptr};
  return Gemm(f.main_, ws_main, scales.alpha, g, rank_dx);
}

// dW[v0:v0+nv]^T (H x nv) += X_c^T (H x C col-major) * G[:, v0:v0+nv]; chunks are added in
// increasing row order, one GEMM per chunk and half: a fixed order.
absl::Status FusedLoss::ChunkPass::DwGemm(int64_t c0, int64_t rows, int64_t v0, int64_t nv,
                                          int32_t sms) {
  const float beta = (a.accumulate_dw || c0 > 0) ? 1.0f : 0.0f;
  const Spec g{/*trans_a=*/false,
               /*trans_b=*/true,
               a.h,
               nv,
               rows,
               Offset(a.x, c0 * a.h, elem),
               a.h,
               logits + v0 * elem,
               a.v,
               ab,
               beta,
               a.dw_acc + v0 * a.h,
               a.h,
               CUDA_R_32F,
               gws,
               sms,
               /*bias=*/nullptr};
  return Gemm(f.side_, ws_side, scales.alpha, g, rank_dw);
}

// Overlapped path: main_ waits for rows [c0, c0 + rows) of X to be on the device before the
// GEMM(s) that read them (row halves: each half's own rows). The dW GEMM on side_ reads the
// same rows without a wait of its own: it follows ce_done_ (after the CE kernel), which
// follows logits_done_ on main_, which follows this wait, so it is covered in both schedules.
absl::Status FusedLoss::ChunkPass::XReady(int64_t c0, int64_t rows) {
  if (a.hooks == nullptr || c0 + rows <= x_ready_rows) return absl::OkStatus();
  x_ready_rows = c0 + rows;
  absl::StatusOr<cudaEvent_t> arrived = a.hooks->XReady(c0, c0 + rows);
  if (!arrived.ok()) return arrived.status();
  if (*arrived == nullptr) return absl::OkStatus();
  return CudaStatus(cudaStreamWaitEvent(f.main_, *arrived, 0), "cudaStreamWaitEvent(X rows)");
}

// Tells the hooks that the chunk's dX GEMM is on main_.
absl::Status FusedLoss::ChunkPass::DxEnqueued(int64_t c0, int64_t rows) {
  if (a.hooks == nullptr || a.dx == nullptr) return absl::OkStatus();
  return a.hooks->DxEnqueued(c0, c0 + rows, f.main_);
}

absl::Status FusedLoss::ChunkPass::DbSum(int64_t rows) {
  return CudaStatus(LaunchColumnSumAccumulate(logits, static_cast<int32_t>(a.dtype), rows,
                                              a.v, scales.alpha, a.db_acc, f.side_),
                    "LaunchColumnSumAccumulate");
}

// Tuning pass: the same GEMMs the chunks below issue, each new one timed on the real
// buffers, serially on main_, before any real work. Logits and dX trials write the chunk
// buffer and dX (both rewritten later); dW trials run with the chunk buffer zeroed, so
// D = beta D + alpha X^T 0 leaves an accumulator as it was and a fresh dW is overwritten by
// the first chunk. With hooks the trials run before any row of X has arrived (no hook is
// called here): they read whatever the device X holds, which only changes what is timed,
// not what is kept, except through the dW trials' X^T 0, which is 0 only for a finite X. So
// the caller fills a streamed X with zeros before Enqueue and uploads rows only after it
// (CudaBackend orders its copies after main_ at the first XReady).
absl::Status FusedLoss::TuneChunks(ChunkPass& c) {
  const DeviceLossArgs& a = c.a;
  const ChunkPlan& plan = c.plan;
  char* logits = c.logits;
  const size_t elem = c.elem;
  const bool columns = c.columns;
  c.tuning = true;
  for (int round = 0; round < 2; ++round) {
    if (round == 1) {
      if (!c.want_dw) break;
      LOSSD_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(
          logits, 0, static_cast<size_t>(plan.chunk_rows) * a.v * elem, main_));
    }
    for (int64_t c0 = 0; c0 < a.bt; c0 += plan.chunk_rows) {
      const int64_t rows = std::min(plan.chunk_rows, a.bt - c0);
      if (round == 1) {
        for (int half = 0; half < (columns ? 2 : 1); ++half) {
          LOSSD_RETURN_IF_ERROR(
              c.DwGemm(c0, rows, c.vbegin[half], c.vcount[half], columns ? c.side_sms : 0));
        }
        continue;
      }
      if (columns) {
        for (int half = 0; half < 2; ++half) {
          LOSSD_RETURN_IF_ERROR(c.LogitsGemm(c0, 0, rows, c.vbegin[half], c.vcount[half],
                                                   half == 0 && c0 > 0 ? c.main_sms : 0));
        }
      } else {
        const int64_t split = RowSplit(rows);
        LOSSD_RETURN_IF_ERROR(c.LogitsGemm(c0, 0, split, 0, a.v, 0));
        if (split < rows) {
          LOSSD_RETURN_IF_ERROR(c.LogitsGemm(c0, split, rows - split, 0, a.v, 0));
        }
      }
      LOSSD_RETURN_IF_ERROR(c.DxGemm(c0, rows, columns && c.want_dw ? c.main_sms : 0));
    }
  }
  c.tuning = false;
  return absl::OkStatus();
}

absl::Status FusedLoss::StartChunks(const ChunkPass& c) {
  const DeviceLossArgs& a = c.a;
  // The side streams start after whatever the caller queued on main_ (input copies).
  LOSSD_CUDA_RETURN_IF_ERROR(cudaEventRecord(start_, main_));
  LOSSD_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(side_, start_, 0));
  LOSSD_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(ce_, start_, 0));
  if (c.want_db && !a.accumulate_db) {
    LOSSD_CUDA_RETURN_IF_ERROR(
        cudaMemsetAsync(a.db_acc, 0, static_cast<size_t>(a.v) * sizeof(float), side_));
  }
  if (c.want_dw && !a.accumulate_dw && a.bt == 0) {
    LOSSD_CUDA_RETURN_IF_ERROR(
        cudaMemsetAsync(a.dw_acc, 0, static_cast<size_t>(a.v) * a.h * sizeof(float), side_));
  }
  return absl::OkStatus();
}

absl::Status FusedLoss::ColumnChunk(ChunkPass& c, int64_t c0, int64_t rows) {
  LOSSD_RETURN_IF_ERROR(c.XReady(c0, rows));
  // Each half of the buffer is rewritten once the previous chunk's dW half has read it
  // (the previous dX, on main_, is already ordered before).
  for (int half = 0; half < 2; ++half) {
    if (c0 > 0) LOSSD_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(main_, dw_done_[half], 0));
    // The first half runs beside the previous chunk's second-half dW; the second alone.
    const int32_t sms = half == 0 && c0 > 0 ? c.main_sms : 0;
    LOSSD_RETURN_IF_ERROR(c.LogitsGemm(c0, 0, rows, c.vbegin[half], c.vcount[half], sms));
  }
  LOSSD_CUDA_RETURN_IF_ERROR(cudaEventRecord(logits_done_[0], main_));
  LOSSD_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(ce_, logits_done_[0], 0));
  LOSSD_RETURN_IF_ERROR(c.CrossEntropy(c0, 0, rows));
  LOSSD_CUDA_RETURN_IF_ERROR(cudaEventRecord(ce_done_[0], ce_));
  LOSSD_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(main_, ce_done_[0], 0));
  LOSSD_RETURN_IF_ERROR(c.DxGemm(c0, rows, c.want_dw ? c.main_sms : 0));
  LOSSD_RETURN_IF_ERROR(c.DxEnqueued(c0, rows));
  if (c.want_dw || c.want_db) {
    LOSSD_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(side_, ce_done_[0], 0));
    // db reads every column, so it goes before the first half is released.
    if (c.want_db) LOSSD_RETURN_IF_ERROR(c.DbSum(rows));
    for (int half = 0; half < 2; ++half) {
      if (c.want_dw) {
        LOSSD_RETURN_IF_ERROR(
            c.DwGemm(c0, rows, c.vbegin[half], c.vcount[half], c.side_sms));
      }
      LOSSD_CUDA_RETURN_IF_ERROR(cudaEventRecord(dw_done_[half], side_));
    }
  }
  return absl::OkStatus();
}

absl::Status FusedLoss::RowHalvesForward(ChunkPass& c, int64_t c0, int64_t rows) {
  const DeviceLossArgs& a = c.a;
  const int64_t split = RowSplit(rows);
  const int64_t nsub = split < rows ? 2 : 1;
  const int64_t begin[2] = {0, split};
  const int64_t count[2] = {split, rows - split};
  // Each half: its rows of X (where they still arrive), its logits GEMM (the first once the
  // previous chunk's dW/db have read the buffer) and its CE under the next half's GEMM. With
  // hooks this thread may block in XReady for the second half's rows: the first half's CE is
  // queued by then. Without hooks the same calls give each stream the same work and waits.
  for (int64_t s = 0; s < nsub; ++s) {
    LOSSD_RETURN_IF_ERROR(c.XReady(c0 + begin[s], count[s]));
    if (c0 > 0 && s == 0) {
      LOSSD_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(main_, dw_done_[0], 0));
    }
    LOSSD_RETURN_IF_ERROR(c.LogitsGemm(c0, begin[s], count[s], 0, a.v, 0));
    LOSSD_CUDA_RETURN_IF_ERROR(cudaEventRecord(logits_done_[s], main_));
    LOSSD_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(ce_, logits_done_[s], 0));
    LOSSD_RETURN_IF_ERROR(c.CrossEntropy(c0, begin[s], count[s]));
    LOSSD_CUDA_RETURN_IF_ERROR(cudaEventRecord(ce_done_[s], ce_));
  }
  return absl::OkStatus();
}

// After the chunk's dX GEMM is on main_: the dW/db accumulation on side_, after the last CE,
// beside dX.
absl::Status FusedLoss::RowHalvesBackward(ChunkPass& c, int64_t c0, int64_t rows) {
  const DeviceLossArgs& a = c.a;
  const int64_t last = RowSplit(rows) < rows ? 1 : 0;
  LOSSD_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(side_, ce_done_[last], 0));
  // Overlapped, the last chunk's dX is what the caller still waits for on the wire:
  // its dX GEMM gets the whole GPU and its rows go out while this dW GEMM runs, instead
  // of both sharing the SMs and dX finishing last. Only the order of two independent
  // GEMMs changes, not what either computes.
  if (a.hooks != nullptr && a.dx != nullptr && c0 + rows >= a.bt) {
    LOSSD_CUDA_RETURN_IF_ERROR(cudaEventRecord(dx_last_, main_));
    LOSSD_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(side_, dx_last_, 0));
  }
  if (c.want_dw) LOSSD_RETURN_IF_ERROR(c.DwGemm(c0, rows, 0, a.v, 0));
  if (c.want_db) LOSSD_RETURN_IF_ERROR(c.DbSum(rows));
  LOSSD_CUDA_RETURN_IF_ERROR(cudaEventRecord(dw_done_[0], side_));
  return absl::OkStatus();
}

absl::Status FusedLoss::RowChunk(ChunkPass& c, int64_t c0, int64_t rows) {
  LOSSD_RETURN_IF_ERROR(RowHalvesForward(c, c0, rows));
  // dX whole-chunk: a half-chunk dX GEMM has too few output tiles when H is small.
  const int64_t last = RowSplit(rows) < rows ? 1 : 0;
  LOSSD_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(main_, ce_done_[last], 0));
  LOSSD_RETURN_IF_ERROR(c.DxGemm(c0, rows, 0));
  LOSSD_RETURN_IF_ERROR(c.DxEnqueued(c0, rows));
  if (c.want_dw || c.want_db) LOSSD_RETURN_IF_ERROR(RowHalvesBackward(c, c0, rows));
  return absl::OkStatus();
}

absl::Status FusedLoss::EnqueueChunks(const DeviceLossArgs& a, const ChunkPlan& plan,
                                      void* workspace) {
  ChunkPass c(*this, a, plan, workspace);
  if (autotune_ && a.bt > 0) LOSSD_RETURN_IF_ERROR(TuneChunks(c));
  LOSSD_RETURN_IF_ERROR(StartChunks(c));
  for (int64_t c0 = 0; c0 < a.bt; c0 += plan.chunk_rows) {
    const int64_t rows = std::min(plan.chunk_rows, a.bt - c0);
    if (c.columns) {
      LOSSD_RETURN_IF_ERROR(ColumnChunk(c, c0, rows));
    } else {
      LOSSD_RETURN_IF_ERROR(RowChunk(c, c0, rows));
    }
  }
  return JoinStreams();
}

absl::Status FusedLoss::JoinStreams() {
  LOSSD_CUDA_RETURN_IF_ERROR(cudaEventRecord(side_end_, side_));
  LOSSD_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(main_, side_end_, 0));
  LOSSD_CUDA_RETURN_IF_ERROR(cudaEventRecord(ce_end_, ce_));
  LOSSD_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(main_, ce_end_, 0));
  return absl::OkStatus();
}

}  // namespace cuda
}  // namespace lossd
