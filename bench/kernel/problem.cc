// SPDX-License-Identifier: Apache-2.0
#include "bench/kernel/problem.h"

#include <cuda_runtime_api.h>

#include <cmath>

#include "bench/kernel/bench_util.h"
#include "bench/kernel/timing.h"
#include "core/dtype.h"

namespace lossd {
namespace bench {

// Device buffers of a (bt, h, v) problem, filled with random data: x ~ U(-1, 1) and
// w ~ U(-a, a) with a = 6 / sqrt(H) (logits of standard deviation 2), random targets; dX,
// fp32 dW and 16 bytes a row for the row results (BenchProblem's layout). Freed by the caller.
int AllocateProblem(int64_t bt, int64_t h, int64_t v, cudaStream_t stream, void** x, void** w,
                    void** dx, void** dw, void** rows, void** tg) {
  BENCH_CHECK_CUDA(cudaMalloc(x, bt * h * 2));
  BENCH_CHECK_CUDA(cudaMalloc(w, v * h * 2));
  BENCH_CHECK_CUDA(cudaMalloc(dx, bt * h * 2));
  BENCH_CHECK_CUDA(cudaMalloc(dw, v * h * 4));
  BENCH_CHECK_CUDA(cudaMalloc(rows, bt * 16));
  BENCH_CHECK_CUDA(cudaMalloc(tg, bt * 4));
  BENCH_CHECK_CUDA(FillUniformBf16(*x, bt * h, 1, 1.0f, stream));
  BENCH_CHECK_CUDA(FillUniformBf16(*w, v * h, 2, 6.0f / std::sqrt(static_cast<float>(h)), stream));
  BENCH_CHECK_CUDA(FillTargets(static_cast<int32_t*>(*tg), bt, 3, static_cast<int32_t>(v), stream));
  return 0;
}

// The benchmark's problem on device buffers: bf16, mean reduction, every target counted
// (summary), dX in bf16 and a fresh fp32 dW; `rows` holds 16 bytes a row (lse, ce, z-loss,
// prediction).
cuda::DeviceLossArgs BenchProblem(int64_t bt, int64_t h, int64_t v, const void* x, const void* w,
                                  const void* tg, void* rows, void* dx, void* dw) {
  cuda::DeviceLossArgs a;
  a.bt = bt;
  a.h = h;
  a.v = v;
  a.dtype = DType::kBF16;
  a.x = x;
  a.w = w;
  a.targets = static_cast<const int32_t*>(tg);
  a.summary.tokens = bt;
  a.summary.weight_sum = static_cast<double>(bt);
  a.summary.class_weight_sum = static_cast<double>(v);
  a.row_lse = static_cast<float*>(rows);
  a.row_ce = a.row_lse + bt;
  a.row_z = a.row_ce + bt;
  a.row_pred = reinterpret_cast<int32_t*>(a.row_z + bt);
  a.dx = dx;
  a.dx_dtype = DType::kBF16;
  a.dw_acc = static_cast<float*>(dw);
  a.accumulate_dw = false;
  return a;
}

int64_t FreeBytes() {
  size_t free_b = 0, total = 0;
  cudaMemGetInfo(&free_b, &total);
  return static_cast<int64_t>(free_b);
}

}  // namespace bench
}  // namespace lossd
