// SPDX-License-Identifier: Apache-2.0
// The kernel benchmark's two optional runs beside the table: a moving BT on one fresh
// autotuning engine (--bt_sweep) and the CUDA backend's whole Compute from host memory
// (--host_io). Each prints its own lines to stdout; neither changes the table's rows.
#ifndef LOSSD_BENCH_KERNEL_EXTRA_RUNS_H_
#define LOSSD_BENCH_KERNEL_EXTRA_RUNS_H_

#include <cstdint>
#include <string>

namespace lossd {
namespace bench {

// A moving BT: one fresh autotuning engine, each BT of `spec` (HxV:BT,BT,...) in turn at the
// default budget. 0; 2 for a bad spec; 1 on a failure.
int RunBtSweep(const std::string& spec);

// The backend's whole Compute from host memory: uploads of X and W, the fused op, downloads of
// dX and dW (bf16). Median of 5 after one warm-up. 0, or 1 on a failure.
int RunHostIo(int64_t bt, int64_t h, int64_t v);

}  // namespace bench
}  // namespace lossd

#endif  // LOSSD_BENCH_KERNEL_EXTRA_RUNS_H_
