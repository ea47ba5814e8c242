// SPDX-License-Identifier: Apache-2.0
// Device kernels of a hosted head's optimizer step (kernels/optimizer.h) and of the squared
// norm of its gradient. The step runs kernels/optimizer_math.h's fp32 code per element, so it
// rounds exactly as the CPU backend does; the sum is deterministic (fixed grid, fixed trees,
// no atomics). Never allocates, validates or synchronises: the caller does.
#ifndef LOSSD_KERNELS_CUDA_OPTIMIZER_H_
#define LOSSD_KERNELS_CUDA_OPTIMIZER_H_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/optimizer.h"

namespace lossd {
namespace cuda {

// One step over t's device buffers (checked by CheckOptimizerStep), queued on `stream`;
// writes t.copy when non-null. The launch's error, if any.
cudaError_t LaunchOptimizerStep(const OptimizerParams& p, const OptimizerTensors& t,
                                cudaStream_t stream);

// Blocks of the first pass: fixed, so the order of every addition is fixed by n alone.
constexpr int kSumOfSquaresBlocks = 1024;
// Doubles of device scratch the sum needs: one partial per block, then the result.
constexpr int kSumOfSquaresScratch = kSumOfSquaresBlocks + 1;

// Sum of x*x over n >= 0 fp32 elements in double, written to scratch[kSumOfSquaresBlocks]:
// each thread sums a fixed stride of elements, each block a fixed tree of its threads, then
// one block a fixed tree of the partials. Reruns are bit-identical; Inf and NaN propagate.
cudaError_t LaunchSumOfSquares(const float* x,  // (n) device
                               int64_t n,
                               double* scratch,  // (kSumOfSquaresScratch) device
                               cudaStream_t stream);

}  // namespace cuda
}  // namespace lossd

#endif  // LOSSD_KERNELS_CUDA_OPTIMIZER_H_
