// SPDX-License-Identifier: Apache-2.0
// The optimizer step's elementwise kernel (one per optimizer and copy dtype) and the
// two-pass sum of squares.
#include "kernels/cuda/optimizer.h"

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "kernels/optimizer.h"
#include "kernels/optimizer_math.h"

namespace lossd {
namespace cuda {
namespace {

namespace om = optimizer_math;

constexpr int kThreads = 256;
// About four times the threads an H200 keeps resident (132 SMs x 2048): enough to hide
// memory latency; larger tensors loop (grid-stride), as a head of 128256 x 4096 does.
constexpr int64_t kMaxStepBlocks = 4096;

enum CopyKind : int { kNoCopy = 0, kCopyBf16 = 1, kCopyF16 = 2, kCopyF32 = 3 };

// The cast core/dtype.h's StoreFromFloat makes on the host, bit for bit: bf16 through the
// shared code; fp16 through the hardware's round-to-nearest-even conversion, which agrees
// with FloatToF16 on every finite value and infinity, with NaN written as FloatToF16 writes
// it (sign, all-ones exponent, the quiet bit) rather than the hardware's canonical NaN.
template <int kCopy>
__device__ __forceinline__ void StoreCopy(void* copy, int64_t i, float x) {
  if (kCopy == kCopyBf16) {
    static_cast<uint16_t*>(copy)[i] = om::Bf16Bits(__float_as_uint(x));
  } else if (kCopy == kCopyF16) {
    const uint32_t bits = __float_as_uint(x);
    static_cast<uint16_t*>(copy)[i] =
        x != x ? static_cast<uint16_t>(((bits >> 16) & 0x8000u) | 0x7e00u)
               : __half_as_ushort(__float2half_rn(x));
  } else if (kCopy == kCopyF32) {
    static_cast<float*>(copy)[i] = x;
  }
}

template <int kCopy>
__global__ void SgdKernel(om::Scalars s, bool weight_decay, bool momentum, bool nesterov,
                          bool initialised, int64_t n,
                          float* __restrict__ param,       // (n)
                          const float* __restrict__ grad,  // (n)
                          float* __restrict__ buf,         // (n), null without momentum
                          void* __restrict__ copy) {       // (n) of the copy dtype
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    float p = param[i];
    float b = momentum ? buf[i] : 0.0f;
    om::SgdElement(s, weight_decay, momentum, nesterov, initialised, &p, grad[i], &b);
    param[i] = p;
    if (momentum) buf[i] = b;
    StoreCopy<kCopy>(copy, i, p);
  }
}

template <int kCopy>
__global__ void AdamWKernel(om::Scalars s, bool amsgrad, int64_t n,
                            float* __restrict__ param,       // (n)
                            const float* __restrict__ grad,  // (n)
                            float* __restrict__ exp_avg,     // (n)
                            float* __restrict__ exp_avg_sq,  // (n)
                            float* __restrict__ max_sq,      // (n), null without amsgrad
                            void* __restrict__ copy) {       // (n) of the copy dtype
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    float p = param[i], m = exp_avg[i], v = exp_avg_sq[i];
    float vmax = amsgrad ? max_sq[i] : 0.0f;
    om::AdamWElement(s, amsgrad, &p, grad[i], &m, &v, &vmax);
    param[i] = p;
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    if (amsgrad) max_sq[i] = vmax;
    StoreCopy<kCopy>(copy, i, p);
  }
}

// The same steps four elements a thread, with 16-byte loads and stores: the scalar kernels
// above issue one 4-byte access per tensor and element and reach about 0.82x copy bandwidth
// on a GPU host. The element math is the same calls in the same order, so results are
// bit-identical to the scalar kernels (and to the CPU step). Used when every pointer is
// 16-byte aligned (the copy: 8 bytes for 2-byte dtypes); elements past n / 4 * 4 go through
// the scalar path of thread 0's block 0.
template <int kCopy>
__device__ __forceinline__ void StoreCopy4(void* copy, int64_t q, const float (&x)[4]) {
  if (kCopy == kCopyF32) {
    reinterpret_cast<float4*>(copy)[q] = make_float4(x[0], x[1], x[2], x[3]);
  } else if (kCopy != kNoCopy) {
    uint16_t h[4];
    for (int k = 0; k < 4; ++k) {
      StoreCopy<kCopy>(h, k, x[k]);
    }
    reinterpret_cast<uint2*>(copy)[q] =
        make_uint2(h[0] | (static_cast<uint32_t>(h[1]) << 16),
                   h[2] | (static_cast<uint32_t>(h[3]) << 16));
  }
}

__device__ __forceinline__ void Load4(const float* a, int64_t q, float (&x)[4]) {
  const float4 v = reinterpret_cast<const float4*>(a)[q];
  x[0] = v.x;
  x[1] = v.y;
  x[2] = v.z;
  x[3] = v.w;
}

__device__ __forceinline__ void Store4(float* a, int64_t q, const float (&x)[4]) {
  reinterpret_cast<float4*>(a)[q] = make_float4(x[0], x[1], x[2], x[3]);
}

template <int kCopy>
__global__ void SgdKernel4(om::Scalars s, bool weight_decay, bool momentum, bool nesterov,
                           bool initialised, int64_t n, float* __restrict__ param,
                           const float* __restrict__ grad, float* __restrict__ buf,
                           void* __restrict__ copy) {
  const int64_t quads = n / 4;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t q = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; q < quads;
       q += stride) {
    float p[4], g[4], b[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    Load4(param, q, p);
    Load4(grad, q, g);
    if (momentum) Load4(buf, q, b);
    for (int k = 0; k < 4; ++k) {
      om::SgdElement(s, weight_decay, momentum, nesterov, initialised, &p[k], g[k], &b[k]);
    }
    Store4(param, q, p);
    if (momentum) Store4(buf, q, b);
    StoreCopy4<kCopy>(copy, q, p);
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    for (int64_t i = quads * 4; i < n; ++i) {
      float p = param[i];
      float b = momentum ? buf[i] : 0.0f;
      om::SgdElement(s, weight_decay, momentum, nesterov, initialised, &p, grad[i], &b);
      param[i] = p;
      if (momentum) buf[i] = b;
      StoreCopy<kCopy>(copy, i, p);
    }
  }
}

template <int kCopy>
__global__ void AdamWKernel4(om::Scalars s, bool amsgrad, int64_t n, float* __restrict__ param,
                             const float* __restrict__ grad, float* __restrict__ exp_avg,
                             float* __restrict__ exp_avg_sq, float* __restrict__ max_sq,
                             void* __restrict__ copy) {
  const int64_t quads = n / 4;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t q = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; q < quads;
       q += stride) {
    float p[4], g[4], m[4], v[4], vmax[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    Load4(param, q, p);
    Load4(grad, q, g);
    Load4(exp_avg, q, m);
    Load4(exp_avg_sq, q, v);
    if (amsgrad) Load4(max_sq, q, vmax);
    for (int k = 0; k < 4; ++k) {
      om::AdamWElement(s, amsgrad, &p[k], g[k], &m[k], &v[k], &vmax[k]);
    }
    Store4(param, q, p);
    Store4(exp_avg, q, m);
    Store4(exp_avg_sq, q, v);
    if (amsgrad) Store4(max_sq, q, vmax);
    StoreCopy4<kCopy>(copy, q, p);
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    for (int64_t i = quads * 4; i < n; ++i) {
      float p = param[i], m = exp_avg[i], v = exp_avg_sq[i];
      float vmax = amsgrad ? max_sq[i] : 0.0f;
      om::AdamWElement(s, amsgrad, &p, grad[i], &m, &v, &vmax);
      param[i] = p;
      exp_avg[i] = m;
      exp_avg_sq[i] = v;
      if (amsgrad) max_sq[i] = vmax;
      StoreCopy<kCopy>(copy, i, p);
    }
  }
}

bool Aligned(const void* ptr, uintptr_t bytes) {
  return reinterpret_cast<uintptr_t>(ptr) % bytes == 0;
}

// Whether the four-wide kernels may run: every tensor 16-byte aligned, the copy as wide as
// four of its elements. Null pointers (absent state) are aligned.
template <int kCopy>
bool VectorOk(const OptimizerTensors& t) {
  const uintptr_t copy_bytes = kCopy == kCopyF32 ? 16 : 8;
  return Aligned(t.param, 16) && Aligned(t.grad, 16) && Aligned(t.state1, 16) &&
         Aligned(t.state2, 16) && Aligned(t.state3, 16) &&
         (kCopy == kNoCopy || Aligned(t.copy, copy_bytes));
}

template <int kCopy>
void LaunchStep(const OptimizerParams& p, const OptimizerTensors& t, int blocks,
                cudaStream_t stream) {
  const om::Scalars s = om::ScalarsOf(p);
  if (VectorOk<kCopy>(t)) {
    const int64_t threads = (t.n / 4 + kThreads - 1) / kThreads;
    const int vblocks = static_cast<int>(std::max<int64_t>(1, std::min(threads, kMaxStepBlocks)));
    if (p.kind == OptimizerKind::kSgd) {
      SgdKernel4<kCopy><<<vblocks, kThreads, 0, stream>>>(
          s, p.weight_decay != 0, p.momentum != 0, p.nesterov, p.momentum_initialised, t.n,
          t.param, t.grad, t.state1, t.copy);
    } else {
      AdamWKernel4<kCopy><<<vblocks, kThreads, 0, stream>>>(
          s, p.amsgrad, t.n, t.param, t.grad, t.state1, t.state2, t.state3, t.copy);
    }
    return;
  }
  if (p.kind == OptimizerKind::kSgd) {
    SgdKernel<kCopy><<<blocks, kThreads, 0, stream>>>(
        s, p.weight_decay != 0, p.momentum != 0, p.nesterov, p.momentum_initialised, t.n,
        t.param, t.grad, t.state1, t.copy);
  } else {
    AdamWKernel<kCopy><<<blocks, kThreads, 0, stream>>>(s, p.amsgrad, t.n, t.param, t.grad,
                                                        t.state1, t.state2, t.state3, t.copy);
  }
}

// Pass one: block b sums elements b*kThreads + j + k*stride for its threads j, each thread in
// index order, then the block's threads in a fixed tree. Every block writes its partial, even
// one with no elements, so pass two always sums kSumOfSquaresBlocks values.
__global__ void SumOfSquaresPartial(const float* __restrict__ x,  // (n)
                                    int64_t n,
                                    double* __restrict__ partial) {  // (kSumOfSquaresBlocks)
  __shared__ double sums[kThreads];
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  double acc = 0;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n;
       i += stride) {
    const double d = x[i];
    acc += d * d;  // exact product (24-bit mantissas): an FMA here rounds the same
  }
  sums[threadIdx.x] = acc;
  __syncthreads();
  for (int half = kThreads / 2; half > 0; half /= 2) {
    if (threadIdx.x < half) sums[threadIdx.x] += sums[threadIdx.x + half];
    __syncthreads();
  }
  if (threadIdx.x == 0) partial[blockIdx.x] = sums[0];
}

// Pass two: one block of kSumOfSquaresBlocks threads, a fixed tree over the partials.
__global__ void SumOfSquaresFinal(double* __restrict__ scratch) {  // (kSumOfSquaresScratch)
  __shared__ double sums[kSumOfSquaresBlocks];
  sums[threadIdx.x] = scratch[threadIdx.x];
  __syncthreads();
  for (int half = kSumOfSquaresBlocks / 2; half > 0; half /= 2) {
    if (threadIdx.x < half) sums[threadIdx.x] += sums[threadIdx.x + half];
    __syncthreads();
  }
  if (threadIdx.x == 0) scratch[kSumOfSquaresBlocks] = sums[0];
}

}  // namespace

cudaError_t LaunchOptimizerStep(const OptimizerParams& p, const OptimizerTensors& t,
                                cudaStream_t stream) {
  if (t.n <= 0) return cudaSuccess;
  const int blocks = static_cast<int>(std::min<int64_t>((t.n + kThreads - 1) / kThreads,
                                                        kMaxStepBlocks));
  if (t.copy == nullptr) {
    LaunchStep<kNoCopy>(p, t, blocks, stream);
  } else {
    switch (t.copy_dtype) {
      case DType::kBF16:
        LaunchStep<kCopyBf16>(p, t, blocks, stream);
        break;
      case DType::kF16:
        LaunchStep<kCopyF16>(p, t, blocks, stream);
        break;
      case DType::kF32:
        LaunchStep<kCopyF32>(p, t, blocks, stream);
        break;
      default:
        return cudaErrorInvalidValue;  // refused by CheckOptimizerStep before this
    }
  }
  return cudaGetLastError();
}

cudaError_t LaunchSumOfSquares(const float* x, int64_t n, double* scratch,
                               cudaStream_t stream) {
  SumOfSquaresPartial<<<kSumOfSquaresBlocks, kThreads, 0, stream>>>(x, n < 0 ? 0 : n, scratch);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return e;
  SumOfSquaresFinal<<<1, kSumOfSquaresBlocks, 0, stream>>>(scratch);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace lossd
