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

// The reference-exp path (row_ref_exp_node.cuh). zt[r] = z[r, targets[r]] = x_r . w_{t_r} in
// fp32, one warp a row.
cudaError_t TargetLogits(const void* x,  // (c, h) bf16 row-major
                         const void* w,  // (v, h) bf16 row-major
                         const int32_t* targets, int64_t c, int64_t h,
                         float* zt,  // (c)
                         cudaStream_t stream);

// The reference the logits GEMM subtracts before its exp: ref[r] = max(zt[r], max_j zs[r, j])
// for r < c (zs: the row's logits at a sample of the vocabulary, so a target logit far below
// the row's top does not overflow exp), 0 for the rows c <= r < ld (the GEMM's epilogue reads
// them). ref <= the row's largest logit, so S >= 1 and nothing underflows as a whole.
cudaError_t RowReference(const float* zt, const float* zs,  // (c), (c, n_sample) row-major
                         int64_t c, int64_t n_sample, int64_t ld,
                         float* ref,  // (ld)
                         cudaStream_t stream);

// From the tile sums of E = exp(z - ref): S[r] = their sum (fixed order), loss[r] = ref[r] +
// log S[r] - zt[r] (= lse - z_target), alpha[r] = scale / S[r], and E[r, targets[r]] <-
// exp(zt[r] - ref[r]) - S[r] (E' = E - S onehot, so G = diag(alpha) E'). *bad counts rows
// whose S is not finite or whose log S exceeds 80 (E may have overflowed: such a chunk needs
// the statistics path); *bad is not zeroed here.
cudaError_t CombineRefExp(const float* tile_sum,  // (n_tiles, ld)
                          int64_t c, int64_t n_tiles, int64_t ld, const int32_t* targets,
                          const float* zt, const float* ref, float scale,
                          void* e,  // (c, v) bf16 row-major: E, one element a row rewritten
                          int64_t v, float* loss, float* alpha, unsigned int* bad,
                          cudaStream_t stream);

// out[r, :] = alpha[r] in[r, :], rounded to bf16; in is bf16 (in_fp32 false) or fp32.
cudaError_t ScaleRows(const void* in, bool in_fp32, const float* alpha, int64_t c, int64_t h,
                      void* out,  // (c, h) bf16
                      cudaStream_t stream);

}  // namespace bench
}  // namespace lossd

#endif  // LOSSD_BENCH_KERNEL_CUTLASS_CE_H_
