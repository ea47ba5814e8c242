// SPDX-License-Identifier: Apache-2.0
// Device helpers of cutlass_logits_bench: the reference per-tile statistics (from the stored
// bf16 logits, in double), the pass that combines per-tile statistics into each row's log-sum-exp,
// and the target-logit gather. Plain kernels for any sm_80+; never linked into the server.
#ifndef LOSSD_BENCH_KERNEL_CUTLASS_CHECK_H_
#define LOSSD_BENCH_KERNEL_CUTLASS_CHECK_H_

#include <cuda_runtime_api.h>

#include <cstdint>

namespace lossd {
namespace bench {

// For each row r < c and column tile t (tile_n columns, the last one possibly short): the
// max of z over the tile and the sum of exp(z - max), summed in double, into ref_max[t * ld + r]
// and ref_sum[t * ld + r].
cudaError_t ReferenceTileStats(const void* z,  // (c, v) bf16 row-major
                               int64_t c, int64_t v, int tile_n, int64_t ld,
                               float* ref_max,  // (ceil(v / tile_n), ld)
                               float* ref_sum,  // (ceil(v / tile_n), ld)
                               cudaStream_t stream);

// lse[r] = log sum_t tile_sum[t, r] exp(tile_max[t, r]) over the n_tiles tiles, in fp32: the
// only work left to a cross-entropy pass for the row's normaliser.
cudaError_t CombineTileStats(const float* tile_max,  // (n_tiles, ld)
                             const float* tile_sum,  // (n_tiles, ld)
                             int64_t c, int64_t n_tiles, int64_t ld,
                             float* lse,  // (c)
                             cudaStream_t stream);

// lse[r] from the stored logits directly (double sums): the reference of CombineTileStats.
cudaError_t ReferenceRowLse(const void* z,  // (c, v) bf16 row-major
                            int64_t c, int64_t v,
                            float* lse,  // (c)
                            cudaStream_t stream);

// out[r] = z[r, targets[r]]: the target logit, gathered from the stored logits.
cudaError_t GatherTargetLogits(const void* z,  // (c, v) bf16 row-major
                               const int32_t* targets,  // (c), each in [0, v)
                               int64_t c, int64_t v,
                               float* out,  // (c)
                               cudaStream_t stream);

}  // namespace bench
}  // namespace lossd

#endif  // LOSSD_BENCH_KERNEL_CUTLASS_CHECK_H_
