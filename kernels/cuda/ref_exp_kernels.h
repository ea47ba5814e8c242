// SPDX-License-Identifier: Apache-2.0
// The small kernels around the reference-exp logits GEMM (ref_exp_gemm.h), which leave no pass
// over the logits in the backward (fused_loss_ref_exp.cc): the target's logit and the row's
// reference before the GEMM, the combine of its tile statistics into the row's results and
// gradient factor after it, and the row scalings of X and dX. Plain CUDA for any sm_80+; C-sized
// work (a chunk's rows, a few bytes a row and tile), never a pass over the C x V logits.
#ifndef LOSSD_KERNELS_CUDA_REF_EXP_KERNELS_H_
#define LOSSD_KERNELS_CUDA_REF_EXP_KERNELS_H_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/cuda/ce_kernels.h"

namespace lossd {
namespace cuda {

// zt[r] = x_r . w_{t_r} in fp32 for rows whose target t_r >= 0; -inf for ignored rows (t_r < 0).
// One warp a row.
cudaError_t LaunchTargetLogits(const void* x,  // (c, h) bf16 row-major
                               const void* w,  // (v, h) bf16 row-major
                               const int32_t* targets, int64_t c, int64_t h,
                               float* zt,  // (c)
                               cudaStream_t stream);

// The reference the GEMM subtracts before its exp: ref[r] = max(zt[r], max_j zs[r, j]) for
// r < c (zs: the row's logits at an even sample of the vocabulary, so a target far below the
// row's top, or an ignored row, does not overflow exp), 0 for c <= r < ld (read by the GEMM's
// epilogue, never used). Each is a logit of the row, so the row's sum of exp(z - ref) is >= 1
// up to rounding: nothing underflows as a whole.
cudaError_t LaunchRowReference(const float* zt, const float* zs,  // (c), (c, n_sample)
                               int64_t c, int64_t n_sample, int64_t ld,
                               float* ref,  // (ld)
                               cudaStream_t stream);

// What the combine reads and writes for a chunk of c rows.
struct RefExpCombineParams {
  // The cross-entropy's terms (TermsOf in ce_device.cuh): targets, class weights, row_scale,
  // the scales, z-loss, token scaling, and the row outputs row_lse / row_ce / row_z /
  // row_pred, all offset to the chunk's first row. label_smoothing must be 0, softcap 0, no
  // bias (their gradients are not a multiple of E - S onehot).
  CrossEntropyParams ce;
  const float* tile_sum = nullptr;    // (n_tiles, ld)
  const float* tile_max = nullptr;    // (n_tiles, ld)
  const int32_t* tile_arg = nullptr;  // (n_tiles, ld)
  int64_t n_tiles = 0, ld = 0;
  const float* zt = nullptr;   // (c)
  const float* ref = nullptr;  // (c)
  void* e = nullptr;           // (c, v) bf16: E, one element a row rewritten
  float* factor = nullptr;     // (c) out: a_r / S_r (0 for an ignored row)
  unsigned int* bad = nullptr;  // incremented once a row whose results cannot be trusted
  // (c) out, where set: 0 for a good row, 1 for a flagged row that a redo with its own largest
  // logit as the reference fixes (that logit is finite), 2 for one it cannot (a non-finite
  // largest logit: non-finite inputs); and the row's largest logit (tile_max's maximum).
  int32_t* row_bad = nullptr;
  float* row_max = nullptr;
  // Where set, the combine runs over these n_only rows of the chunk only (the redone rows,
  // RefExpRedoRows); the others are left as they are.
  const int32_t* only_rows = nullptr;
  int64_t n_only = 0;
};

// For each row r: S = the sum of its tile sums (a fixed order), lse = ref + log S, row_pred =
// the column of the largest tile maximum (the first on ties), and for a non-ignored row its
// TermsOf (ce, z-loss, a, hot) with factor[r] = a / S and E[r, t] <- exp(zt - ref) - (hot / a) S,
// so that the row's gradient is G_r = factor[r] E'_r exactly as the cross-entropy kernel's
// g_j = a p_j - hot [j == t] (ignored rows: row_ce = row_z = 0, factor 0, E left as it is).
// *bad counts rows whose E may have overflowed or whose sum is not finite (log S > 80, or not
// finite): the caller must not use such a chunk's E. *bad is not zeroed here.
cudaError_t LaunchCombineRefExp(const RefExpCombineParams& p, cudaStream_t stream);

// The flagged rows of a chunk, for the per-row redo (fused_loss_ref_exp.cc): idx[0..k) the rows
// with row_bad == 1 in ascending order, ref_redo[i] = row_max[idx[i]] for i < k and 0 up to
// ref_len, counts[0] = k and counts[1] = the rows with row_bad == 2. One block; deterministic.
cudaError_t LaunchCompactFlagged(const int32_t* row_bad, const float* row_max, int64_t c,
                                 int32_t* idx, float* ref_redo, int64_t ref_len,
                                 unsigned int* counts, cudaStream_t stream);

// dst[i, :] = src[idx[i], :] for i < n, rows of `cols` bf16 (cols a multiple of 8, 16-byte
// aligned rows).
cudaError_t LaunchGatherRows(const void* src, const int32_t* idx, int64_t n, int64_t cols,
                             void* dst, cudaStream_t stream);

// The redo's results into the chunk's: for i < n and r = idx[i], E row r <- e_redo row i (v
// bf16), its tile statistics (n_tiles entries, leading dimensions ld_redo and ld) and
// ref[r] <- ref_redo[i].
struct RefExpScatter {
  const int32_t* idx = nullptr;
  int64_t n = 0, v = 0, n_tiles = 0, ld_redo = 0, ld = 0;
  const void* e_redo = nullptr;
  const float *sum_redo = nullptr, *max_redo = nullptr, *ref_redo = nullptr;
  const int32_t* arg_redo = nullptr;
  void* e = nullptr;
  float *tile_sum = nullptr, *tile_max = nullptr, *ref = nullptr;
  int32_t* tile_arg = nullptr;
};
cudaError_t LaunchScatterRedo(const RefExpScatter& s, cudaStream_t stream);

// Blocks of 256 threads for `n` items of a memory-bound grid-stride kernel, at most eight a
// multiprocessor of the current device: enough resident threads to keep the memory system
// busy, and no more (each thread then loops). At least one block.
unsigned ResidentGrid(int64_t n);

// out[r, :] = factor[r] in[r, :], rounded once to out's type. in: bf16 or fp32; out: bf16 or
// fp32 (ElemType codes kElemBF16 / kElemF32).
cudaError_t LaunchScaleRows(const void* in, int32_t in_elem, const float* factor, int64_t c,
                            int64_t h, void* out, int32_t out_elem, cudaStream_t stream);

}  // namespace cuda
}  // namespace lossd

#endif  // LOSSD_KERNELS_CUDA_REF_EXP_KERNELS_H_
