// SPDX-License-Identifier: Apache-2.0
// The loss kinds' kernel launches, for row_loss_kernels.cu's LaunchRowLoss (not part of
// row_loss_kernels.h's public contract): the same RowLossParams; the one-read kernels split a
// row over a cluster of `cluster` blocks (RowLossCluster chose it). None checks the problem.
#ifndef LOSSD_KERNELS_CUDA_ROW_LOSS_LAUNCH_H_
#define LOSSD_KERNELS_CUDA_ROW_LOSS_LAUNCH_H_

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/row_loss_kernels.h"

namespace lossd {
namespace cuda {

// Columns per block of the one-read kernels at most: logprob and policy hold one row's segment
// in shared memory (as cross-entropy's, 64 KB in bf16), distill two (the student's and the
// teacher's), so half as many columns keep its blocks at the same 64 KB.
inline constexpr int64_t kRowOneReadSegCols = 32768;
inline constexpr int64_t kDistillOneReadSegCols = 16384;

// Blocks per row of the one-read kernel of p's kind on the current device, or 0 where the
// two-pass kernel runs p (V not a multiple of 8, a row or a bias not 16-byte aligned, V wider
// than 16 segments, or no thread block clusters).
int RowLossCluster(const RowLossParams& p);

// The one-read logprob / policy kernel (row_one_read_kernel.cu) and distill kernel
// (distill_one_read_kernel.cu); cudaErrorInvalidValue for an element type they do not know.
cudaError_t LaunchRowLossOneRead(const RowLossParams& p, int cluster, cudaStream_t stream);
cudaError_t LaunchDistillOneRead(const RowLossParams& p, int cluster, cudaStream_t stream);

// The two-pass distill kernel (distill_kernel.cu): one block per row, three reads of it.
cudaError_t LaunchDistillTwoPass(const RowLossParams& p, cudaStream_t stream);

}  // namespace cuda
}  // namespace lossd

#endif  // LOSSD_KERNELS_CUDA_ROW_LOSS_LAUNCH_H_
