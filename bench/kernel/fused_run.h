// SPDX-License-Identifier: Apache-2.0
// One shape of the kernel benchmark: the fused op at every budget and schedule, each timed in
// the same rounds as the 3-GEMM floor (cuBLASLt's first choices, and tuned), with its measured
// extra memory, where its time goes (its GEMMs alone, the CE kernels alone), and at the first
// budget its determinism and float64 accuracy. Fills a Row; prints progress to stderr only.
#ifndef LOSSD_BENCH_KERNEL_FUSED_RUN_H_
#define LOSSD_BENCH_KERNEL_FUSED_RUN_H_

#include <cstdint>
#include <vector>

#include "bench/kernel/row.h"
#include "kernels/cuda/fused_loss.h"

namespace lossd {
namespace bench {

// A --budgets_mib entry "Nr" (N rows a chunk) is kept as kRowsBudget | N.
inline constexpr uint64_t kRowsBudget = 1ull << 62;

// Rows the default budget holds (DefaultChunkBudget's min_rows): the device's tuning, set once
// by bench_kernel before any shape runs, as CudaBackend plans it.
void SetDefaultChunkRows(int64_t rows);

// `engine` runs the fused op and the tuned floor; `floor_engine`, never tuned, the floor with
// cuBLASLt's first choices. A budget of 0 is the backend's default for the shape. 0, or 1 on a
// failure (printed).
int RunShape(cuda::FusedLoss& engine, cuda::FusedLoss& floor_engine, int64_t bt, int64_t h,
             int64_t v,
             const std::vector<uint64_t>& budgets, const std::vector<Config>& schedules,
             Row* row);

}  // namespace bench
}  // namespace lossd

#endif  // LOSSD_BENCH_KERNEL_FUSED_RUN_H_
