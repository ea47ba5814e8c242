// SPDX-License-Identifier: Apache-2.0
// The kernel benchmark's report on stdout: the table of the fused op against its floor at
// every shape, budget and schedule (and the same rows as CSV with --csv), then the float64
// accuracy table. Prints what was measured; measures nothing.
#ifndef LOSSD_BENCH_KERNEL_REPORT_H_
#define LOSSD_BENCH_KERNEL_REPORT_H_

#include <cuda_runtime_api.h>

#include <cstdio>
#include <vector>

#include "bench/kernel/row.h"

namespace lossd {
namespace bench {

// The GPU line and the table, one line per configuration and a summary line per shape; the
// same configurations to --csv when it names a file.
// ref_exp: the fused op ran the reference-exp path (FusedLoss::ref_exp).
void PrintTable(const cudaDeviceProp& prop, const std::vector<Row>& rows, bool ref_exp);

// The accuracy table of the rows checked against float64. True when every checked row is
// within the bar (dX and dW relative norm error 3e-3, the loss 1e-5 relative).
bool PrintAccuracy(const std::vector<Row>& rows);

}  // namespace bench
}  // namespace lossd

#endif  // LOSSD_BENCH_KERNEL_REPORT_H_
