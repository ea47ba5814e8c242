// SPDX-License-Identifier: Apache-2.0
// The kernel benchmark's checks of the fused op's outputs at full size: determinism (two runs,
// dX and dW compared word for word after the second's outputs were poisoned) and, with
// --check_fp64, the loss, dX and dW against the float64 reference. Checks what was computed;
// times nothing.
#ifndef LOSSD_BENCH_KERNEL_OUTPUT_CHECKS_H_
#define LOSSD_BENCH_KERNEL_OUTPUT_CHECKS_H_

#include <cstdint>

#include "bench/kernel/row.h"
#include "kernels/cuda/fused_loss.h"

namespace lossd {
namespace bench {

// Runs the fused op twice with `plan` on `ws` and records into *row whether dX and dW came
// out the same, the mean loss, and (--check_fp64) the worst float64 errors so far. x, w and tg
// are the problem `a` describes, dx and dw its outputs (device). 0, or 1 on a failure.
int CheckOutputs(cuda::FusedLoss& engine, const cuda::DeviceLossArgs& a,
                 const cuda::ChunkPlan& plan, void* ws, int64_t bt, int64_t h, int64_t v,
                 const void* x, const void* w, const void* tg, void* dx, void* dw, Row* row);

}  // namespace bench
}  // namespace lossd

#endif  // LOSSD_BENCH_KERNEL_OUTPUT_CHECKS_H_
