// SPDX-License-Identifier: Apache-2.0
#include "bench/kernel/reference_fp64.h"

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <string>
#include <vector>

namespace lossd {
namespace bench {
namespace {

__global__ void Bf16ToDouble(const __nv_bfloat16* src, double* dst, int64_t n) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    dst[i] = static_cast<double>(__bfloat162float(src[i]));
  }
}

// One block a row of z (C, V) in place: z becomes G = (softmax(z) - onehot(t)) / BT, and
// loss[r] = lse - z[t]. Two passes over the row (max, then the sum), all in double.
__global__ void RowSoftmaxGrad(double* z, int64_t v, const int32_t* targets, double inv_bt,
                               double* loss) {
  __shared__ double red[32];
  double* row = z + static_cast<int64_t>(blockIdx.x) * v;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  auto block_reduce = [&](double x, bool is_max) {
    for (int o = 16; o > 0; o /= 2) {
      const double y = __shfl_xor_sync(0xffffffffu, x, o);
      x = is_max ? fmax(x, y) : x + y;
    }
    __syncthreads();  // red[] may still be read from the last reduction
    if (lane == 0) red[warp] = x;
    __syncthreads();
    x = is_max ? -INFINITY : 0.0;
    for (int i = 0; i < warps; ++i) x = is_max ? fmax(x, red[i]) : x + red[i];
    return x;
  };
  double m = -INFINITY;
  for (int64_t j = threadIdx.x; j < v; j += blockDim.x) m = fmax(m, row[j]);
  m = block_reduce(m, true);
  double s = 0;
  for (int64_t j = threadIdx.x; j < v; j += blockDim.x) s += exp(row[j] - m);
  s = block_reduce(s, false);
  const double lse = m + log(s);
  const int32_t t = targets[blockIdx.x];
  if (threadIdx.x == 0) loss[blockIdx.x] = lse - row[t];
  __syncthreads();  // row[t] read before it is overwritten
  for (int64_t j = threadIdx.x; j < v; j += blockDim.x) {
    row[j] = (exp(row[j] - lse) - (j == t ? 1.0 : 0.0)) * inv_bt;
  }
}

// sums[0] += sum (got - ref)^2, sums[1] += sum ref^2. A diagnostic: the atomics' order does
// not matter at the precision the result is read at.
template <typename T>
__device__ __forceinline__ double AsDouble(T x);
template <>
__device__ __forceinline__ double AsDouble(__nv_bfloat16 x) {
  return static_cast<double>(__bfloat162float(x));
}
template <>
__device__ __forceinline__ double AsDouble(float x) {
  return static_cast<double>(x);
}

template <typename T>
__global__ void SquaredErrors(const T* got, const double* ref, int64_t n, double* sums) {
  double e = 0, r = 0;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const double d = AsDouble(got[i]) - ref[i];
    e += d * d;
    r += ref[i] * ref[i];
  }
  for (int o = 16; o > 0; o /= 2) {
    e += __shfl_xor_sync(0xffffffffu, e, o);
    r += __shfl_xor_sync(0xffffffffu, r, o);
  }
  if (threadIdx.x % 32 == 0) {
    atomicAdd(&sums[0], e);
    atomicAdd(&sums[1], r);
  }
}

constexpr int kGrid = 1024, kBlock = 256;

}  // namespace

bool CompareWithFp64(int64_t bt, int64_t h, int64_t v, const void* x, const void* w,
                     const int32_t* targets, double loss, const void* dx, const float* dw,
                     int64_t row_chunk, Fp64Errors* errors, std::string* error) {
  std::vector<void*> held;
  cublasHandle_t handle = nullptr;
  auto fail = [&](const std::string& what) {
    *error = what;
    for (void* p : held) cudaFree(p);
    if (handle != nullptr) cublasDestroy(handle);
    return false;
  };
  auto alloc = [&](size_t bytes, void** p) {
    if (cudaMalloc(p, bytes) != cudaSuccess) return false;
    held.push_back(*p);
    return true;
  };
#define REF_CUDA(expr)                                                                   \
  do {                                                                                   \
    const cudaError_t e_ = (expr);                                                       \
    if (e_ != cudaSuccess) return fail(std::string(#expr) + ": " + cudaGetErrorString(e_)); \
  } while (0)
#define REF_CUBLAS(expr)                                                          \
  do {                                                                            \
    const cublasStatus_t s_ = (expr);                                             \
    if (s_ != CUBLAS_STATUS_SUCCESS) {                                            \
      return fail(std::string(#expr) + ": cuBLAS status " + std::to_string(s_)); \
    }                                                                             \
  } while (0)

  // The fused op ran on its own non-blocking streams; this runs on the legacy stream.
  REF_CUDA(cudaDeviceSynchronize());
  const int64_t c = row_chunk < bt ? row_chunk : bt;
  double *x64, *w64, *dw64, *z, *dx64, *row_loss, *sums;
  if (!alloc(bt * h * 8, reinterpret_cast<void**>(&x64)) ||
      !alloc(v * h * 8, reinterpret_cast<void**>(&w64)) ||
      !alloc(v * h * 8, reinterpret_cast<void**>(&dw64)) ||
      !alloc(c * v * 8, reinterpret_cast<void**>(&z)) ||
      !alloc(c * h * 8, reinterpret_cast<void**>(&dx64)) ||
      !alloc(bt * 8, reinterpret_cast<void**>(&row_loss)) ||
      !alloc(4 * 8, reinterpret_cast<void**>(&sums))) {
    return fail("cudaMalloc of the float64 reference's buffers failed");
  }
  REF_CUBLAS(cublasCreate(&handle));
  // Plain double arithmetic: no emulation or reduced-precision modes.
  REF_CUBLAS(cublasSetMathMode(handle, CUBLAS_PEDANTIC_MATH));
  Bf16ToDouble<<<kGrid, kBlock>>>(static_cast<const __nv_bfloat16*>(x), x64, bt * h);
  Bf16ToDouble<<<kGrid, kBlock>>>(static_cast<const __nv_bfloat16*>(w), w64, v * h);
  REF_CUDA(cudaGetLastError());
  REF_CUDA(cudaMemset(sums, 0, 4 * 8));
  const double one = 1, zero = 0, inv_bt = 1.0 / static_cast<double>(bt);
  for (int64_t r0 = 0; r0 < bt; r0 += c) {
    const int64_t rows = bt - r0 < c ? bt - r0 : c;
    const double* xc = x64 + r0 * h;
    // Row-major (rows, V) logits = Xc W^T, i.e. column-major (V, rows) = W^T' Xc'.
    REF_CUBLAS(cublasDgemm(handle, CUBLAS_OP_T, CUBLAS_OP_N, v, rows, h, &one, w64, h, xc, h,
                           &zero, z, v));
    RowSoftmaxGrad<<<rows, 512>>>(z, v, targets + r0, inv_bt, row_loss + r0);
    REF_CUDA(cudaGetLastError());
    // dXc (rows, H) = G W.
    REF_CUBLAS(cublasDgemm(handle, CUBLAS_OP_N, CUBLAS_OP_N, h, rows, v, &one, w64, h, z, v,
                           &zero, dx64, h));
    // dW (V, H) += G^T Xc.
    const double* beta = r0 == 0 ? &zero : &one;
    REF_CUBLAS(cublasDgemm(handle, CUBLAS_OP_N, CUBLAS_OP_T, h, v, rows, &one, xc, h, z, v, beta,
                           dw64, h));
    SquaredErrors<<<kGrid, kBlock>>>(static_cast<const __nv_bfloat16*>(dx) + r0 * h, dx64,
                                     rows * h, sums);
    REF_CUDA(cudaGetLastError());
  }
  SquaredErrors<<<kGrid, kBlock>>>(dw, dw64, v * h, sums + 2);
  REF_CUDA(cudaGetLastError());
  std::vector<double> host_loss(bt), host_sums(4);
  REF_CUDA(cudaMemcpy(host_loss.data(), row_loss, bt * 8, cudaMemcpyDeviceToHost));
  REF_CUDA(cudaMemcpy(host_sums.data(), sums, 4 * 8, cudaMemcpyDeviceToHost));
  double ref_loss = 0;
  for (double l : host_loss) ref_loss += l;
  ref_loss /= static_cast<double>(bt);
  errors->ref_loss = ref_loss;
  errors->loss_rel = std::fabs(loss - ref_loss) / std::fabs(ref_loss);
  errors->dx_rel_norm = std::sqrt(host_sums[0] / host_sums[1]);
  errors->dw_rel_norm = std::sqrt(host_sums[2] / host_sums[3]);
  for (void* p : held) cudaFree(p);
  cublasDestroy(handle);
  return true;
#undef REF_CUDA
#undef REF_CUBLAS
}

}  // namespace bench
}  // namespace lossd
