// SPDX-License-Identifier: Apache-2.0
#include "bench/kernel/bench_util.h"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

namespace lossd {
namespace bench {
namespace {

__device__ __forceinline__ uint64_t Mix(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  x ^= x >> 33;
  return x;
}

__global__ void FillBf16Kernel(__nv_bfloat16* dst, int64_t n, uint64_t seed, float scale) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const uint64_t r = Mix(seed * 0x9e3779b97f4a7c15ull + static_cast<uint64_t>(i));
    const float u = static_cast<float>(r >> 40) * (1.0f / 16777216.0f);  // [0, 1)
    dst[i] = __float2bfloat16_rn((2.0f * u - 1.0f) * scale);
  }
}

__global__ void FillTargetsKernel(int32_t* dst, int64_t n, uint64_t seed, int32_t range) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    dst[i] = static_cast<int32_t>(Mix(seed + 0x1234567ull * static_cast<uint64_t>(i)) %
                                  static_cast<uint64_t>(range));
  }
}

__global__ void MismatchKernel(const uint32_t* a, const uint32_t* b, int64_t n,
                               unsigned long long* count) {
  unsigned long long local = 0;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    local += a[i] != b[i];
  }
  if (local != 0) atomicAdd(count, local);  // an integer count: order does not matter
}

}  // namespace

cudaError_t FillUniformBf16(void* dst, int64_t n, uint64_t seed, float scale,
                            cudaStream_t stream) {
  FillBf16Kernel<<<2048, 256, 0, stream>>>(static_cast<__nv_bfloat16*>(dst), n, seed, scale);
  return cudaGetLastError();
}

cudaError_t FillTargets(int32_t* dst, int64_t n, uint64_t seed, int32_t range,
                        cudaStream_t stream) {
  FillTargetsKernel<<<256, 256, 0, stream>>>(dst, n, seed, range);
  return cudaGetLastError();
}

cudaError_t CountMismatches(const void* a, const void* b, int64_t n_words,
                            unsigned long long* mismatches, cudaStream_t stream) {
  cudaError_t e = cudaMemsetAsync(mismatches, 0, sizeof(unsigned long long), stream);
  if (e != cudaSuccess) return e;
  MismatchKernel<<<2048, 256, 0, stream>>>(static_cast<const uint32_t*>(a),
                                           static_cast<const uint32_t*>(b), n_words, mismatches);
  return cudaGetLastError();
}

}  // namespace bench
}  // namespace lossd
