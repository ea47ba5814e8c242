// SPDX-License-Identifier: Apache-2.0
// How the kernel benchmark times and meters work it enqueues on a CUDA stream: CUDA events in
// rounds (every body at the same clock), the median of each, and the board's energy over a
// long back-to-back run. Times what it is given; never checks what the work computes. Its
// checks print the failed call and make the calling function return 1.
#ifndef LOSSD_BENCH_KERNEL_TIMING_H_
#define LOSSD_BENCH_KERNEL_TIMING_H_

#include <cuda_runtime_api.h>

#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "bench/kernel/gpu_energy.h"

#define BENCH_CHECK_CUDA(expr)                                                          \
  do {                                                                                  \
    cudaError_t e_ = (expr);                                                            \
    if (e_ != cudaSuccess) {                                                            \
      std::fprintf(stderr, "%s failed: %s (%s:%d)\n", #expr, cudaGetErrorString(e_),    \
                   __FILE__, __LINE__);                                                 \
      return 1;                                                                         \
    }                                                                                   \
  } while (0)
#define BENCH_CHECK_OK(expr)                                                            \
  do {                                                                                  \
    absl::Status s_ = (expr);                                                           \
    if (!s_.ok()) {                                                                     \
      std::fprintf(stderr, "%s failed: %s\n", #expr, s_.ToString().c_str());            \
      return 1;                                                                         \
    }                                                                                   \
  } while (0)

namespace lossd {
namespace bench {

double Median(std::vector<double> v);

// Times the bodies (which enqueue on `stream`) in rounds, each once a round, after `warmup`
// rounds: the median milliseconds of each in *medians. 0, or 1 on a failure (printed).
int TimeRoundsMs(cudaStream_t stream, int warmup, int runs,
                 const std::vector<std::function<absl::Status()>>& bodies,
                 std::vector<double>* medians);

// Times `body` (which enqueues on `stream`) alone: median milliseconds.
int TimeMs(cudaStream_t stream, int warmup, int runs, std::function<absl::Status()> body,
           double* median_ms);

// The board's energy counter when --energy_seconds asks for it (Main opens it).
extern GpuEnergy* g_meter;

// `body` back to back for about --energy_seconds (nothing without g_meter): milliseconds and
// joules per run and the mean power, printed as one line named `what`.
int MeasureEnergy(cudaStream_t stream, const std::string& what,
                  const std::function<absl::Status()>& body);

}  // namespace bench
}  // namespace lossd

#endif  // LOSSD_BENCH_KERNEL_TIMING_H_
