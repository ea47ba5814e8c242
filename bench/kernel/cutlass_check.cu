// SPDX-License-Identifier: Apache-2.0
#include "bench/kernel/cutlass_check.h"

#include <cuda_bf16.h>

#include <cmath>

namespace lossd {
namespace bench {
namespace {

__global__ void ReferenceTileStatsKernel(const __nv_bfloat16* z, int64_t c, int64_t v,
                                         int tile_n, int64_t ld, float* ref_max, float* ref_sum) {
  const int64_t r = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  const int64_t t = blockIdx.y;
  if (r >= c) return;
  const int64_t c0 = t * tile_n, c1 = c0 + tile_n < v ? c0 + tile_n : v;
  const __nv_bfloat16* row = z + r * v;
  double m = -INFINITY;
  for (int64_t j = c0; j < c1; ++j) m = fmax(m, double(__bfloat162float(row[j])));
  double s = 0;
  for (int64_t j = c0; j < c1; ++j) s += exp(double(__bfloat162float(row[j])) - m);
  ref_max[t * ld + r] = float(m);
  ref_sum[t * ld + r] = float(s);
}

// One thread a row; threads of a warp read neighbouring rows of one tile, which are adjacent
// in the M-major statistics.
__global__ void CombineTileStatsKernel(const float* tile_max, const float* tile_sum, int64_t c,
                                       int64_t n_tiles, int64_t ld, float* lse) {
  const int64_t r = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (r >= c) return;
  float m = -INFINITY, s = 0.f;
  for (int64_t t = 0; t < n_tiles; ++t) {
    const float m2 = tile_max[t * ld + r], s2 = tile_sum[t * ld + r];
    const float mx = fmaxf(m, m2);
    s = s * __expf(m - mx) + s2 * __expf(m2 - mx);
    m = mx;
  }
  lse[r] = m + logf(s);
}

// One block a row, double sums: slow and plain, as a reference should be.
__global__ void ReferenceRowLseKernel(const __nv_bfloat16* z, int64_t v, float* lse) {
  __shared__ double part[256];
  const __nv_bfloat16* row = z + blockIdx.x * v;
  double m = -INFINITY;
  for (int64_t j = threadIdx.x; j < v; j += blockDim.x) m = fmax(m, double(__bfloat162float(row[j])));
  part[threadIdx.x] = m;
  __syncthreads();
  for (int w = blockDim.x / 2; w > 0; w /= 2) {
    if (threadIdx.x < w) part[threadIdx.x] = fmax(part[threadIdx.x], part[threadIdx.x + w]);
    __syncthreads();
  }
  m = part[0];
  __syncthreads();
  double s = 0;
  for (int64_t j = threadIdx.x; j < v; j += blockDim.x) s += exp(double(__bfloat162float(row[j])) - m);
  part[threadIdx.x] = s;
  __syncthreads();
  for (int w = blockDim.x / 2; w > 0; w /= 2) {
    if (threadIdx.x < w) part[threadIdx.x] += part[threadIdx.x + w];
    __syncthreads();
  }
  if (threadIdx.x == 0) lse[blockIdx.x] = float(m + log(part[0]));
}

__global__ void GatherKernel(const __nv_bfloat16* z, const int32_t* targets, int64_t c, int64_t v,
                             float* out) {
  const int64_t r = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (r < c) out[r] = __bfloat162float(z[r * v + targets[r]]);
}

}  // namespace

cudaError_t ReferenceTileStats(const void* z, int64_t c, int64_t v, int tile_n, int64_t ld,
                               float* ref_max, float* ref_sum, cudaStream_t stream) {
  const dim3 grid(unsigned((c + 127) / 128), unsigned((v + tile_n - 1) / tile_n));
  ReferenceTileStatsKernel<<<grid, 128, 0, stream>>>(static_cast<const __nv_bfloat16*>(z), c, v,
                                                      tile_n, ld, ref_max, ref_sum);
  return cudaGetLastError();
}

cudaError_t CombineTileStats(const float* tile_max, const float* tile_sum, int64_t c,
                             int64_t n_tiles, int64_t ld, float* lse, cudaStream_t stream) {
  CombineTileStatsKernel<<<unsigned((c + 127) / 128), 128, 0, stream>>>(tile_max, tile_sum, c,
                                                                        n_tiles, ld, lse);
  return cudaGetLastError();
}

cudaError_t ReferenceRowLse(const void* z, int64_t c, int64_t v, float* lse,
                            cudaStream_t stream) {
  ReferenceRowLseKernel<<<unsigned(c), 256, 0, stream>>>(static_cast<const __nv_bfloat16*>(z), v,
                                                         lse);
  return cudaGetLastError();
}

cudaError_t GatherTargetLogits(const void* z, const int32_t* targets, int64_t c, int64_t v,
                               float* out, cudaStream_t stream) {
  GatherKernel<<<unsigned((c + 127) / 128), 128, 0, stream>>>(
      static_cast<const __nv_bfloat16*>(z), targets, c, v, out);
  return cudaGetLastError();
}

}  // namespace bench
}  // namespace lossd
