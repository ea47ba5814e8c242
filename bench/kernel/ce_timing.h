// SPDX-License-Identifier: Apache-2.0
// The kernel benchmark's cross-entropy kernels timed alone over the fused op's chunks (the
// one-read and the two-pass kernel), beside a device copy of the same bytes. Times; never
// checks what the kernels compute.
#ifndef LOSSD_BENCH_KERNEL_CE_TIMING_H_
#define LOSSD_BENCH_KERNEL_CE_TIMING_H_

#include <cstdint>

#include "bench/kernel/row.h"
#include "kernels/cuda/fused_loss.h"

namespace lossd {
namespace bench {

// The cross-entropy kernels alone over the chunks of `chunk_rows` rows, both kernels: the
// one-read kernel where it applies (row->ce_ms) and the two-pass kernel (row->ce_two_pass_ms),
// over real logits in z (C x V bf16; gws is a GEMM workspace).
int TimeCrossEntropy(cuda::FusedLoss& engine, const cuda::DeviceLossArgs& a, int64_t bt,
                     int64_t h, int64_t v, int64_t chunk_rows, const void* w, const void* x,
                     void* z, void* gws, uint64_t gws_bytes, Row* row);

}  // namespace bench
}  // namespace lossd

#endif  // LOSSD_BENCH_KERNEL_CE_TIMING_H_
