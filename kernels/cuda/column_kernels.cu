// SPDX-License-Identifier: Apache-2.0
// The small kernels beside the cross-entropy: the fixed-order column sum that accumulates db,
// the fp32-to-storage cast of the gradients, and the softcap's tanh for its tests.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/ce_device.cuh"
#include "kernels/cuda/ce_kernels.h"
#include "kernels/cuda/softcap_tanh.h"

namespace lossd {
namespace cuda {
namespace {

template <typename T>
__global__ void ColumnSumKernel(const T* g, int64_t rows, int64_t v, float alpha, float* acc) {
  const int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= v) return;
  float s = 0.0f;
#pragma unroll 8
  for (int64_t r = 0; r < rows; ++r) s += ToFloat<T>(g[r * v + j]);
  acc[j] += alpha * s;
}

template <typename T>
__global__ void CastKernel(const float* src, T* dst, int64_t n) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    dst[i] = FromFloat<T>(src[i]);
  }
}

__global__ void SoftcapTanhKernel(const float* x, float* y, int64_t n) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    y[i] = SoftcapTanh(x[i]);
  }
}

}  // namespace

cudaError_t LaunchColumnSumAccumulate(const void* g, int32_t elem, int64_t rows, int64_t v,
                                      float alpha, float* acc, cudaStream_t stream) {
  if (rows <= 0 || v <= 0) return cudaSuccess;
  const unsigned blocks = static_cast<unsigned>((v + 255) / 256);
  switch (elem) {
    case kElemBF16:
      ColumnSumKernel<<<blocks, 256, 0, stream>>>(static_cast<const __nv_bfloat16*>(g), rows, v,
                                                  alpha, acc);
      break;
    case kElemF16:
      ColumnSumKernel<<<blocks, 256, 0, stream>>>(static_cast<const __half*>(g), rows, v, alpha,
                                                  acc);
      break;
    case kElemF32:
      ColumnSumKernel<<<blocks, 256, 0, stream>>>(static_cast<const float*>(g), rows, v, alpha,
                                                  acc);
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

cudaError_t LaunchCastFromFloat(const float* src, void* dst, int32_t elem, int64_t n,
                                cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  const int64_t want = (n + 255) / 256;
  const unsigned blocks = static_cast<unsigned>(want < 4096 ? want : 4096);
  switch (elem) {
    case kElemBF16:
      CastKernel<<<blocks, 256, 0, stream>>>(src, static_cast<__nv_bfloat16*>(dst), n);
      break;
    case kElemF16:
      CastKernel<<<blocks, 256, 0, stream>>>(src, static_cast<__half*>(dst), n);
      break;
    case kElemF32:
      CastKernel<<<blocks, 256, 0, stream>>>(src, static_cast<float*>(dst), n);
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

cudaError_t LaunchSoftcapTanh(const float* x, float* y, int64_t n, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  const int64_t want = (n + 255) / 256;
  const unsigned blocks = static_cast<unsigned>(want < 4096 ? want : 4096);
  SoftcapTanhKernel<<<blocks, 256, 0, stream>>>(x, y, n);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace lossd
