// SPDX-License-Identifier: Apache-2.0
// The non-finite check's kernel: a grid-stride read of 32-bit words, each tested for an
// all-ones exponent in both 16-bit halves (bf16, fp16) or as a whole (fp32).
#include "kernels/cuda/nonfinite.h"

#include <cuda_runtime.h>

#include <cstdint>

namespace lossd {
namespace cuda {
namespace {

// lo: the exponent mask of the low 16-bit element (0 for fp32); hi: of the high half (or of
// the fp32 value: bf16's high-half mask and fp32's are the same bits).
__device__ __forceinline__ bool WordBad(uint32_t w, uint32_t lo, uint32_t hi) {
  return (lo != 0 && (w & lo) == lo) || (w & hi) == hi;
}

__global__ void NonFiniteKernel(const uint8_t* data,  // (bytes) device
                                int64_t bytes, bool vec16, uint32_t lo, uint32_t hi,
                                uint32_t bit, uint32_t* flags) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  bool bad = false;
  int64_t done = 0;  // bytes covered by the vector loop
  if (vec16) {
    const uint4* v = reinterpret_cast<const uint4*>(data);
    const int64_t n = bytes / 16;
    for (int64_t i = tid; i < n; i += stride) {
      const uint4 q = v[i];
      bad |= WordBad(q.x, lo, hi) | WordBad(q.y, lo, hi) | WordBad(q.z, lo, hi) |
             WordBad(q.w, lo, hi);
    }
    done = n * 16;
  }
  const uint32_t* w = reinterpret_cast<const uint32_t*>(data + done);
  const int64_t words = (bytes - done) / 4;
  for (int64_t i = tid; i < words; i += stride) bad |= WordBad(w[i], lo, hi);
  // An odd count of 16-bit elements leaves one half-word.
  if (tid == 0 && bytes % 4 == 2) {
    const uint32_t last = *reinterpret_cast<const uint16_t*>(data + bytes - 2);
    bad |= lo != 0 && (last & lo) == lo;
  }
  if (__syncthreads_or(bad) && threadIdx.x == 0) atomicOr(flags, bit);
}

}  // namespace

cudaError_t LaunchNonFiniteCheck(const void* data, int32_t elem, int64_t n, uint32_t bit,
                                 uint32_t* flags, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  uint32_t lo = 0, hi = 0;
  int64_t size = 0;
  switch (elem) {
    case 0: lo = 0x7F80u; hi = 0x7F800000u; size = 2; break;  // bf16
    case 1: lo = 0x7C00u; hi = 0x7C000000u; size = 2; break;  // fp16
    case 2: lo = 0; hi = 0x7F800000u; size = 4; break;        // fp32
    default: return cudaErrorInvalidValue;
  }
  const uintptr_t at = reinterpret_cast<uintptr_t>(data);
  if (at % 4 != 0) return cudaErrorMisalignedAddress;
  const int64_t bytes = n * size;
  // Enough blocks to fill an H200 several times over, few enough that each thread reads many
  // words (the flag costs one atomic per block at most).
  const int64_t want = (bytes / 16 + 255) / 256;
  const unsigned blocks = static_cast<unsigned>(want < 2048 ? (want > 0 ? want : 1) : 2048);
  NonFiniteKernel<<<blocks, 256, 0, stream>>>(static_cast<const uint8_t*>(data), bytes,
                                              at % 16 == 0, lo, hi, bit, flags);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace lossd
