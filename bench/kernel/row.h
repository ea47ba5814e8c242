// SPDX-License-Identifier: Apache-2.0
// What the kernel benchmark measured at one shape (a Row: the fused op at each budget and
// schedule, beside its floor, and the shape's parts alone and checks) and one timed
// configuration of the fused op. Plain data; the report prints it.
#ifndef LOSSD_BENCH_KERNEL_ROW_H_
#define LOSSD_BENCH_KERNEL_ROW_H_

#include <cstdint>
#include <vector>

#include "bench/kernel/reference_fp64.h"

namespace lossd {
namespace bench {

struct Row {
  int64_t bt, h, v;
  struct Fused {
    uint64_t budget;
    bool is_default = false;  // the backend's default budget for the shape
    int schedule;
    int side_sms;
    int64_t chunk_rows;
    int blocks = 0;  // whole-batch layout's vocabulary blocks
    double gemms_ms = 0;  // this budget's chunked GEMMs alone (first schedule of each budget)
    double ms;
    // The floor timed in the same rounds as this configuration: cuBLASLt's first choice for
    // each GEMM, and the fastest of its first kTuneCandidates for each.
    double floor_ms = 0, tuned_floor_ms = 0;
    uint64_t workspace;
    int64_t measured_extra;
  };
  std::vector<Fused> fused;
  double gemms_ms = 0;  // the chunked GEMMs alone, one stream, first budget's chunks
  double ce_ms = 0;     // the cross-entropy kernels alone over the same chunks
  double ce_two_pass_ms = 0;  // the same with the two-pass kernel forced
  int ce_cluster = 0;         // blocks per row of the one-read kernel (0: two-pass)
  double whole_gemms_ms = 0;  // the whole-batch layout's GEMMs alone, first budget
  bool deterministic = true;
  double mean_loss;
  bool checked_fp64 = false;  // fp64 holds the errors against the float64 reference
  Fp64Errors fp64;
};

// One timed configuration: a schedule and the dW GEMMs' SM target.
struct Config {
  int schedule;
  int side_sms;
};

}  // namespace bench
}  // namespace lossd

#endif  // LOSSD_BENCH_KERNEL_ROW_H_
