// SPDX-License-Identifier: Apache-2.0
// The cross-entropy pass of the fused path issue 26 measures after the CUTLASS spike's go: the
// logits GEMM's epilogue has already written each row tile's max and sum of exp
// (row_stats_node.cuh), so what is left of the pass is (1) combining a row's tile statistics
// into its log-sum-exp and loss, a few bytes a tile, and (2) forming G over the stored logits,
// an elementwise pass with no reduction that runs at copy speed. Plain kernels for any sm_80+;
// bench only, never linked into the server.
#ifndef LOSSD_BENCH_KERNEL_CUTLASS_CE_H_
#define LOSSD_BENCH_KERNEL_CUTLASS_CE_H_

#include <cuda_runtime_api.h>

#include <cstdint>

namespace lossd {
namespace bench {

// For each row r < c: lse[r] = log sum_t tile_sum[t, r] exp(tile_max[t, r]) over n_tiles
// tiles, and loss[r] = lse[r] - z[r, targets[r]] (the mean cross-entropy's term of row r before
// its 1/BT). A block combines 32 rows, 32 tile slices each, in a fixed order (bit-identical
// reruns).
cudaError_t CombineRowLoss(const float* tile_max,  // (n_tiles, ld)
                           const float* tile_sum,  // (n_tiles, ld)
                           int64_t c, int64_t n_tiles, int64_t ld,
                           const void* z,           // (c, v) bf16 row-major
                           int64_t v,
                           const int32_t* targets,  // (c), each in [0, v)
                           float* lse,              // (c)
                           float* loss,             // (c)
                           cudaStream_t stream);

// G over the stored logits, in place: z[r, j] <- scale (exp(z[r, j] - lse[r]) - [j == t_r]),
// rounded to bf16 (scale = 1 / BT for the mean). Needs v % 8 == 0 and z 16-byte aligned: every
// thread moves 16 bytes at a time.
cudaError_t FormGradient(void* z,  // (c, v) bf16 row-major
                         int64_t c, int64_t v, const float* lse, const int32_t* targets,
                         float scale, cudaStream_t stream);

}  // namespace bench
}  // namespace lossd

#endif  // LOSSD_BENCH_KERNEL_CUTLASS_CE_H_
