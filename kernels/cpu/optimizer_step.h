// SPDX-License-Identifier: Apache-2.0
// The CPU backend's optimizer step and gradient norm (kernels/optimizer.h) over host fp32
// buffers, split into fixed blocks on the CPU task pool. Never validates (the backend runs
// CheckOptimizerStep first) and never allocates.
#ifndef LOSSD_KERNELS_CPU_OPTIMIZER_STEP_H_
#define LOSSD_KERNELS_CPU_OPTIMIZER_STEP_H_

#include <cstdint>

#include "kernels/optimizer.h"

namespace lossd {

class CpuTaskPool;

// One step in place: fp32 arithmetic in torch's single-tensor order (kernels/optimizer_math.h,
// the same code the CUDA kernel runs), then t.copy = the cast of the new master. Elementwise,
// so the result never depends on the pool's thread count. pool may be null (one thread).
void CpuOptimizerStep(const OptimizerParams& p, const OptimizerTensors& t, CpuTaskPool* pool);

// Sum of x*x over n fp32 elements in double. Each product is exact in double; the sums run
// in fixed blocks (8 running sums per block, then the blocks in order), so the result depends
// on n and the data only. NaN and Inf propagate as in any sum.
double CpuSumOfSquares(const float* x,  // (n) host
                       int64_t n, CpuTaskPool* pool);

}  // namespace lossd

#endif  // LOSSD_KERNELS_CPU_OPTIMIZER_STEP_H_
