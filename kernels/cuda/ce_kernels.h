// SPDX-License-Identifier: Apache-2.0
// Device kernels of the fused linear + cross-entropy, behind plain POD parameter structs and
// host launchers: the per-row cross-entropy (forward statistics and the logits gradient written
// in place over the stored logits), the bias-gradient column sum and the accumulator cast.
// Never allocates memory and never synchronises; every launcher returns the launch's error.
#ifndef LOSSD_KERNELS_CUDA_CE_KERNELS_H_
#define LOSSD_KERNELS_CUDA_CE_KERNELS_H_

#include <cuda_runtime_api.h>

#include <cstdint>

namespace lossd {
namespace cuda {

// Element type codes shared with lossd::DType (kBF16 = 0, kF16 = 1, kF32 = 2).
enum ElemType : int32_t { kElemBF16 = 0, kElemF16 = 1, kElemF32 = 2 };

// One chunk of C rows of stored logits z = x W^T (no bias yet, input dtype).
//   z'_ij  = softcap(z_ij + b_j)                                  (fp32, in registers)
//   lse_i  = log sum_j exp z'_ij
//   ce_i   = (1 - eps) cw_t (lse_i - z'_it) + (eps / V) (S lse_i - sum_j cw_j z'_ij)
//   g_ij   = [ ce_s ((1 - eps) cw_t (p_ij - [j == t]) + (eps / V)(S p_ij - cw_j))
//            + z_s 2 zs lse_i p_ij ] * softcap'(z_ij + b_j)
// with S = sum_j cw_j, ce_s = ce_scale * row_scale_i, z_s = z_scale * row_scale_i. With
// token_scaling, ce_i, zs lse_i^2 and g_i are multiplied by s_i = exp(z'_it - lse_i) rounded to
// elem (Liger's use_token_scaling), taken from the same zt and lse: no extra pass.
// Every value is read in the input dtype and widened to fp32 inside the kernel, with the same
// per-thread element order for every dtype, so bf16 logits and the same values given as fp32
// give bit-identical statistics, and gradients that are identical after rounding.
// Most vocabulary blocks a row may be split into (CrossEntropyParams::segments).
inline constexpr int kMaxSegments = 16;

struct CrossEntropyParams {
  void* logits;                 // (rows, v) row-major, elem; overwritten by g when write_grad
  int32_t elem;                 // ElemType of logits and bias
  int64_t rows;                 // C
  int64_t v;                    // V
  const void* bias;             // (v) elem, or null
  const int32_t* targets;       // (rows) in [0, v), or -1 for an ignored row
  const float* class_weights;   // (v), or null for all ones
  const float* row_scale;       // (rows) upstream per-row gradient (reduction none), or null
  float ce_scale;               // gradient multiplier of the cross-entropy part
  float z_scale;                // gradient multiplier of the z-loss part
  float label_smoothing;        // eps
  float z_loss_scale;           // zs
  float softcap;                // > 0: z' = softcap * tanh(z / softcap)
  float class_weight_sum;       // S
  int32_t write_grad;           // 0: statistics only, logits left as they are
  int32_t token_scaling;        // 1: rows scaled by s_i (see above)
  float* row_lse;               // (rows) lse_i, every row
  float* row_ce;                // (rows) ce_i, 0 for ignored rows
  float* row_z;                 // (rows) zs lse_i^2, 0 for ignored rows
  int32_t* row_pred;            // (rows) argmax_j z'_ij, first index on ties
  // Blocked rows (the whole-batch layout of fused_loss.h): when segments > 0, logits is unused
  // and the row's columns come in `segments` blocks in increasing column order: block s holds
  // columns [seg_col0[s], seg_col0[s] + seg_cols[s]), row r at seg_base[s] + r * seg_cols[s]
  // elements. The seg_cols sum to v.
  int32_t segments;
  // 1: the two-pass kernel even where the one-read kernel applies (tests and benchmarks that
  // compare the two).
  int32_t two_pass;
  // > 0: at most this many columns per block of the one-read kernel (a multiple of 8, at most
  // kOneReadSegCols; narrower segments mean more blocks per row, up to 16 where the GPU places
  // such clusters). 0: kOneReadSegCols. For benchmarks that compare segment widths.
  int32_t one_read_cols;
  void* seg_base[kMaxSegments];
  int64_t seg_col0[kMaxSegments];
  int64_t seg_cols[kMaxSegments];
};

// Two kernels compute the same formulas. The one-read kernel splits each row over a cluster of
// blocks that keep their segments in shared memory, so the row is read from global memory once
// (the two-pass kernel reads it twice: for the statistics, then for the gradient). It is used
// for contiguous rows with V % 8 == 0 and V <= (blocks per row) * kOneReadSegCols, on GPUs
// with thread block clusters (compute capability 9.0 and later): 8 blocks per row (the
// portable cluster size, V <= 262144), or 16 where the GPU places such clusters (Hopper,
// V <= 524288). The two-pass kernel runs the rest (the blocked layout, odd V, wider V, older
// GPUs). Each kernel is deterministic, with the same per-thread element order for every dtype.
inline constexpr int64_t kOneReadSegCols = 32768;  // columns per block at most

// Blocks per row the one-read kernel may use on the current device: 0 (no clusters), 8 or 16.
int CrossEntropyMaxCluster();

// Blocks per row of the one-read kernel for these parameters on the current device, or 0 when
// the two-pass kernel runs them.
int CrossEntropyCluster(const CrossEntropyParams& p);

cudaError_t LaunchCrossEntropy(const CrossEntropyParams& p, cudaStream_t stream);

// acc[j] += alpha * sum_{r < rows} g[r, j], rows summed in a fixed order (deterministic).
cudaError_t LaunchColumnSumAccumulate(const void* g,  // (rows, v) row-major, elem
                                      int32_t elem, int64_t rows, int64_t v, float alpha,
                                      float* acc,  // (v) fp32
                                      cudaStream_t stream);

// dst[i] = round(src[i]) into elem, for i < n.
cudaError_t LaunchCastFromFloat(const float* src,  // (n) fp32
                                void* dst,         // (n) elem
                                int32_t elem, int64_t n, cudaStream_t stream);

// y[i] = tanh(x[i]) as the softcap computes it on this GPU (softcap_tanh.h's SoftcapTanh), for
// i < n: the accuracy test's window onto the kernels' tanh.
cudaError_t LaunchSoftcapTanh(const float* x, float* y, int64_t n, cudaStream_t stream);

}  // namespace cuda
}  // namespace lossd

#endif  // LOSSD_KERNELS_CUDA_CE_KERNELS_H_
