// SPDX-License-Identifier: Apache-2.0
// The kernel benchmark's problem: random bf16 X and W, random targets, dX, an fp32 dW and the
// row results on the device, and the fused op's arguments over them (bf16, mean reduction,
// every target counted). Allocates and describes; never times or checks anything.
#ifndef LOSSD_BENCH_KERNEL_PROBLEM_H_
#define LOSSD_BENCH_KERNEL_PROBLEM_H_

#include <cstdint>

#include "kernels/cuda/fused_loss.h"

namespace lossd {
namespace bench {

// Device buffers of a (bt, h, v) problem, filled with random data: x ~ U(-1, 1) and
// w ~ U(-a, a) with a = 6 / sqrt(H) (logits of standard deviation 2), random targets; dX,
// fp32 dW and 16 bytes a row for the row results (BenchProblem's layout). Freed by the caller.
// 0, or 1 on a CUDA failure (printed).
int AllocateProblem(int64_t bt, int64_t h, int64_t v, cudaStream_t stream, void** x, void** w,
                    void** dx, void** dw, void** rows, void** tg);

// The benchmark's problem on device buffers: bf16, mean reduction, every target counted
// (summary), dX in bf16 and a fresh fp32 dW; `rows` holds 16 bytes a row (lse, ce, z-loss,
// prediction).
cuda::DeviceLossArgs BenchProblem(int64_t bt, int64_t h, int64_t v, const void* x, const void* w,
                                  const void* tg, void* rows, void* dx, void* dw);

// Free device memory now, in bytes.
int64_t FreeBytes();

}  // namespace bench
}  // namespace lossd

#endif  // LOSSD_BENCH_KERNEL_PROBLEM_H_
