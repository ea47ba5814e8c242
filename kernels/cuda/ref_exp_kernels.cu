#include "kernels/cuda/ref_exp_kernels.h"

#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "kernels/cuda/ce_device.cuh"
#include "kernels/cuda/ce_kernels.h"

namespace lossd {
namespace cuda {
namespace {

constexpr int kCombineRows = 32;    // rows a block combines (threadIdx.x: consecutive rows)
constexpr int kCombineSlices = 32;  // tile slices a row's tiles are split over (threadIdx.y)

__global__ void TargetLogitsKernel(const __nv_bfloat16* __restrict__ x,
                                   const __nv_bfloat16* __restrict__ w,
                                   const int32_t* __restrict__ targets, int64_t c, int64_t h,
                                   float* zt) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (r >= c) return;
  const int32_t t = targets[r];
  if (t < 0) {
    if (lane == 0) zt[r] = -INFINITY;
    return;
  }
  const __nv_bfloat162* xr = reinterpret_cast<const __nv_bfloat162*>(x + r * h);
  const __nv_bfloat162* wr = reinterpret_cast<const __nv_bfloat162*>(w + t * h);
  float acc = 0.0f;
  for (int64_t j = lane; j < h / 2; j += 32) {
    const float2 a = __bfloat1622float2(xr[j]), b = __bfloat1622float2(wr[j]);
    acc = fmaf(a.x, b.x, fmaf(a.y, b.y, acc));
  }
  for (int d = 16; d > 0; d /= 2) acc += __shfl_down_sync(0xFFFFFFFF, acc, d);
  if (lane == 0) zt[r] = acc;
}

__global__ void RowReferenceKernel(const float* __restrict__ zt, const float* __restrict__ zs,
                                   int64_t c, int64_t n_sample, int64_t ld, float* ref) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (r >= ld) return;
  if (r >= c) {
    if (lane == 0) ref[r] = 0.0f;
    return;
  }
  float m = zt[r];
  for (int64_t j = lane; j < n_sample; j += 32) m = fmaxf(m, zs[r * n_sample + j]);
  for (int d = 16; d > 0; d /= 2) m = fmaxf(m, __shfl_down_sync(0xFFFFFFFF, m, d));
  if (lane == 0) ref[r] = m;
}

// (m, a) <- the larger of (m, a) and (m2, a2), the first column on ties.
__device__ __forceinline__ void ArgMaxMerge(float& m, int32_t& a, float m2, int32_t a2) {
  if (m2 > m || (m2 == m && a2 < a)) {
    m = m2;
    a = a2;
  }
}

__global__ void CombineRefExpKernel(const RefExpCombineParams p) {
  __shared__ float ss[kCombineSlices][kCombineRows + 1];
  __shared__ float sm[kCombineSlices][kCombineRows + 1];
  __shared__ int32_t sa[kCombineSlices][kCombineRows + 1];
  const int64_t c = p.ce.rows, ld = p.ld;
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kCombineRows + threadIdx.x;
  float s = 0.0f, m = -INFINITY;
  int32_t arg = INT32_MAX;
  if (r < c) {
    for (int64_t t = threadIdx.y; t < p.n_tiles; t += kCombineSlices) {
      s += p.tile_sum[t * ld + r];
      ArgMaxMerge(m, arg, p.tile_max[t * ld + r], p.tile_arg[t * ld + r]);
    }
  }
  ss[threadIdx.y][threadIdx.x] = s;
  sm[threadIdx.y][threadIdx.x] = m;
  sa[threadIdx.y][threadIdx.x] = arg;
  __syncthreads();
  if (threadIdx.y != 0 || r >= c) return;
  for (int k = 1; k < kCombineSlices; ++k) {
    s += ss[k][threadIdx.x];
    ArgMaxMerge(m, arg, sm[k][threadIdx.x], sa[k][threadIdx.x]);
  }
  const float log_s = logf(s);
  const float lse = Add(p.ref[r], log_s);
  p.ce.row_lse[r] = lse;
  // A row of NaN logits has no maximum: its first column, as a kernel reading them would say.
  p.ce.row_pred[r] = arg == INT32_MAX ? 0 : arg;
  // E may have overflowed (a logit more than ~88 above the reference) or S be useless.
  if (!(log_s <= 80.0f) || !isfinite(lse)) atomicAdd(p.bad, 1u);
  const int32_t t = p.ce.targets[r];
  if (t < 0) {
    p.ce.row_ce[r] = 0.0f;
    p.ce.row_z[r] = 0.0f;
    p.factor[r] = 0.0f;
    return;
  }
  const RowTerms terms = TermsOf(p.ce, r, t, lse, p.zt[r], 0.0f);
  p.ce.row_ce[r] = terms.ce;
  p.ce.row_z[r] = terms.zl;
  p.factor[r] = terms.a / s;
  // g_t = a p_t - hot = (a / S) (E_t - (hot / a) S); with a == 0 the factor is 0 and E_t is
  // never used.
  const float hot_share = terms.a != 0.0f ? terms.hot / terms.a : 0.0f;
  __nv_bfloat16* e = static_cast<__nv_bfloat16*>(p.e);
  e[r * p.ce.v + t] = __float2bfloat16_rn(expf(p.zt[r] - p.ref[r]) - hot_share * s);
}

template <typename In, typename Out>
__global__ void ScaleRowsKernel(const In* __restrict__ in, const float* __restrict__ factor,
                                int64_t c, int64_t h, Out* out) {
  const int64_t n = c * h, stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    out[i] = FromFloat<Out>(factor[i / h] * ToFloat<In>(in[i]));
  }
}

template <typename In>
cudaError_t ScaleRowsTo(const In* in, const float* factor, int64_t c, int64_t h, void* out,
                        int32_t out_elem, cudaStream_t stream) {
  const unsigned grid = ResidentGrid(c * h);
  if (out_elem == kElemBF16) {
    ScaleRowsKernel<<<grid, 256, 0, stream>>>(in, factor, c, h,
                                              static_cast<__nv_bfloat16*>(out));
  } else if (out_elem == kElemF32) {
    ScaleRowsKernel<<<grid, 256, 0, stream>>>(in, factor, c, h, static_cast<float*>(out));
  } else {
    return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace

unsigned ResidentGrid(int64_t n) {
  int sms = 0, dev = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  return static_cast<unsigned>(
      std::clamp<int64_t>((n + 255) / 256, 1, int64_t{std::max(sms, 1)} * 8));
}

cudaError_t LaunchTargetLogits(const void* x, const void* w, const int32_t* targets, int64_t c,
                               int64_t h, float* zt, cudaStream_t stream) {
  if (h % 2 != 0) return cudaErrorInvalidValue;
  if (c <= 0) return cudaSuccess;
  const unsigned grid = static_cast<unsigned>((c + 7) / 8);  // 8 warps a block
  TargetLogitsKernel<<<grid, 256, 0, stream>>>(static_cast<const __nv_bfloat16*>(x),
                                               static_cast<const __nv_bfloat16*>(w), targets, c,
                                               h, zt);
  return cudaGetLastError();
}

cudaError_t LaunchRowReference(const float* zt, const float* zs, int64_t c, int64_t n_sample,
                               int64_t ld, float* ref, cudaStream_t stream) {
  if (ld < c) return cudaErrorInvalidValue;
  if (ld == 0) return cudaSuccess;
  const unsigned grid = static_cast<unsigned>((ld + 7) / 8);
  RowReferenceKernel<<<grid, 256, 0, stream>>>(zt, zs, c, n_sample, ld, ref);
  return cudaGetLastError();
}

cudaError_t LaunchCombineRefExp(const RefExpCombineParams& p, cudaStream_t stream) {
  if (p.ce.label_smoothing != 0.0f || p.ce.softcap != 0.0f || p.ce.bias != nullptr ||
      p.ce.elem != kElemBF16 || p.ld < p.ce.rows) {
    return cudaErrorInvalidValue;
  }
  if (p.ce.rows <= 0) return cudaSuccess;
  const dim3 block(kCombineRows, kCombineSlices);
  const unsigned grid = static_cast<unsigned>((p.ce.rows + kCombineRows - 1) / kCombineRows);
  CombineRefExpKernel<<<grid, block, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t LaunchScaleRows(const void* in, int32_t in_elem, const float* factor, int64_t c,
                            int64_t h, void* out, int32_t out_elem, cudaStream_t stream) {
  if (c * h == 0) return cudaSuccess;
  if (in_elem == kElemBF16) {
    return ScaleRowsTo(static_cast<const __nv_bfloat16*>(in), factor, c, h, out, out_elem,
                       stream);
  }
  if (in_elem == kElemF32) {
    return ScaleRowsTo(static_cast<const float*>(in), factor, c, h, out, out_elem, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace cuda
}  // namespace lossd
