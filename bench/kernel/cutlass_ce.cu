// SPDX-License-Identifier: Apache-2.0
#include "bench/kernel/cutlass_ce.h"

#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>

#include "kernels/cuda/ref_exp_kernels.h"  // ResidentGrid

namespace lossd {
namespace bench {
namespace {

constexpr int kRows = 32;    // rows a block combines (threadIdx.x: consecutive rows, coalesced)
constexpr int kSlices = 32;  // tile slices a row's tiles are split over (threadIdx.y)

// (m, s) <- the merge of (m, s) and (m2, s2), states of (max, sum of exp(z - max)); two empty
// states (-inf, 0) stay empty.
__device__ __forceinline__ void Merge(float& m, float& s, float m2, float s2) {
  const float mx = fmaxf(m, m2);
  if (mx == -INFINITY) return;
  s = s * __expf(m - mx) + s2 * __expf(m2 - mx);
  m = mx;
}

__global__ void CombineRowLossKernel(const float* __restrict__ tmax,
                                     const float* __restrict__ tsum, int64_t c, int64_t n_tiles,
                                     int64_t ld, const __nv_bfloat16* __restrict__ z, int64_t v,
                                     const int32_t* __restrict__ targets, float* lse,
                                     float* loss) {
  __shared__ float sm[kSlices][kRows + 1], ss[kSlices][kRows + 1];
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kRows + threadIdx.x;
  float m = -INFINITY, s = 0.0f;
  if (r < c) {
    for (int64_t t = threadIdx.y; t < n_tiles; t += kSlices) {
      Merge(m, s, tmax[t * ld + r], tsum[t * ld + r]);
    }
  }
  sm[threadIdx.y][threadIdx.x] = m;
  ss[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y != 0 || r >= c) return;
  for (int k = 1; k < kSlices; ++k) Merge(m, s, sm[k][threadIdx.x], ss[k][threadIdx.x]);
  const float l = m + logf(s);
  lse[r] = l;
  loss[r] = l - __bfloat162float(z[r * v + targets[r]]);
}

// One 16-byte vector (8 logits of one row, as v % 8 == 0) a thread per step; a grid of eight
// 256-thread blocks an SM keeps enough loads in flight to run at copy speed.
__global__ void FormGradientKernel(uint4* z, int64_t n_vec, int64_t vec_per_row,
                                   const float* __restrict__ lse,
                                   const int32_t* __restrict__ targets, float scale) {
  constexpr float kLog2e = 1.4426950408889634f;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n_vec;
       i += stride) {
    const int64_t r = i / vec_per_row;
    const int64_t j0 = (i - r * vec_per_row) * 8;
    const float l2 = lse[r] * kLog2e;
    const int32_t t = targets[r];
    uint4 u = z[i];
    __nv_bfloat162* p = reinterpret_cast<__nv_bfloat162*>(&u);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const float2 f = __bfloat1622float2(p[k]);
      float g0 = scale * exp2f(fmaf(f.x, kLog2e, -l2));
      float g1 = scale * exp2f(fmaf(f.y, kLog2e, -l2));
      if (j0 + 2 * k == t) g0 -= scale;
      if (j0 + 2 * k + 1 == t) g1 -= scale;
      p[k] = __floats2bfloat162_rn(g0, g1);
    }
    z[i] = u;
  }
}

}  // namespace

cudaError_t CombineRowLoss(const float* tile_max, const float* tile_sum, int64_t c,
                           int64_t n_tiles, int64_t ld, const void* z, int64_t v,
                           const int32_t* targets, float* lse, float* loss, cudaStream_t stream) {
  if (c <= 0) return cudaSuccess;
  const dim3 block(kRows, kSlices);
  const unsigned grid = static_cast<unsigned>((c + kRows - 1) / kRows);
  CombineRowLossKernel<<<grid, block, 0, stream>>>(tile_max, tile_sum, c, n_tiles, ld,
                                                   static_cast<const __nv_bfloat16*>(z), v,
                                                   targets, lse, loss);
  return cudaGetLastError();
}

cudaError_t FormGradient(void* z, int64_t c, int64_t v, const float* lse,
                         const int32_t* targets, float scale, cudaStream_t stream) {
  if (v % 8 != 0 || reinterpret_cast<uintptr_t>(z) % 16 != 0) return cudaErrorInvalidValue;
  const int64_t n_vec = c * v / 8;
  if (n_vec == 0) return cudaSuccess;
  const unsigned grid = cuda::ResidentGrid(n_vec);
  FormGradientKernel<<<grid, 256, 0, stream>>>(static_cast<uint4*>(z), n_vec, v / 8, lse,
                                               targets, scale);
  return cudaGetLastError();
}


}  // namespace bench
}  // namespace lossd
