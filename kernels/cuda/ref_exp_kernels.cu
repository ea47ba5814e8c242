// SPDX-License-Identifier: Apache-2.0
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
  const int64_t ld = p.ld;
  const int64_t j = static_cast<int64_t>(blockIdx.x) * kCombineRows + threadIdx.x;
  // With only_rows the block's threads take listed rows; c bounds the list instead.
  const int64_t c = p.only_rows != nullptr ? p.n_only : p.ce.rows;
  const int64_t r = p.only_rows != nullptr && j < c ? p.only_rows[j] : j;
  float s = 0.0f, m = -INFINITY;
  int32_t arg = INT32_MAX;
  if (j < c) {
    for (int64_t t = threadIdx.y; t < p.n_tiles; t += kCombineSlices) {
      s += p.tile_sum[t * ld + r];
      ArgMaxMerge(m, arg, p.tile_max[t * ld + r], p.tile_arg[t * ld + r]);
    }
  }
  ss[threadIdx.y][threadIdx.x] = s;
  sm[threadIdx.y][threadIdx.x] = m;
  sa[threadIdx.y][threadIdx.x] = arg;
  __syncthreads();
  if (threadIdx.y != 0 || j >= c) return;
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
  const bool bad = !(log_s <= 80.0f) || !isfinite(lse);
  if (bad) atomicAdd(p.bad, 1u);
  if (p.row_bad != nullptr) {
    p.row_bad[r] = bad ? (isfinite(m) ? 1 : 2) : 0;
    p.row_max[r] = m;
  }
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

constexpr int kCompactThreads = 1024;

// One block: the flagged rows in ascending order, a block-wide prefix count per 1024 rows.
__global__ void CompactFlaggedKernel(const int32_t* __restrict__ row_bad,
                                     const float* __restrict__ row_max, int64_t c,
                                     int32_t* idx, float* ref_redo, int64_t ref_len,
                                     unsigned int* counts) {
  __shared__ int warp_sums[kCompactThreads / 32];
  __shared__ int base_s;
  __shared__ unsigned int hopeless_s;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (threadIdx.x == 0) {
    base_s = 0;
    hopeless_s = 0;
  }
  __syncthreads();
  for (int64_t r0 = 0; r0 < c; r0 += kCompactThreads) {
    const int64_t r = r0 + threadIdx.x;
    const int32_t b = r < c ? row_bad[r] : 0;
    if (b == 2) atomicAdd(&hopeless_s, 1u);
    const unsigned mask = __ballot_sync(0xFFFFFFFF, b == 1);
    if (lane == 0) warp_sums[warp] = __popc(mask);
    __syncthreads();
    int before = base_s;
    for (int k = 0; k < warp; ++k) before += warp_sums[k];
    before += __popc(mask & ((1u << lane) - 1));
    if (b == 1) {
      idx[before] = static_cast<int32_t>(r);
      if (before < ref_len) ref_redo[before] = row_max[r];
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      for (int k = 0; k < kCompactThreads / 32; ++k) base_s += warp_sums[k];
    }
    __syncthreads();
  }
  const int k = base_s;
  for (int64_t i = k + threadIdx.x; i < ref_len; i += kCompactThreads) ref_redo[i] = 0.0f;
  if (threadIdx.x == 0) {
    counts[0] = static_cast<unsigned int>(k);
    counts[1] = hopeless_s;
  }
}

__global__ void GatherRowsKernel(const uint4* __restrict__ src, const int32_t* __restrict__ idx,
                                 int64_t n, int64_t vecs, uint4* dst) {
  for (int64_t i = blockIdx.y; i < n; i += gridDim.y) {
    const uint4* s = src + static_cast<int64_t>(idx[i]) * vecs;
    for (int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < vecs;
         j += static_cast<int64_t>(gridDim.x) * blockDim.x) {
      dst[i * vecs + j] = s[j];
    }
  }
}

__global__ void ScatterRedoKernel(const RefExpScatter s) {
  const int64_t vecs = s.v / 8;
  const uint4* src = static_cast<const uint4*>(s.e_redo);
  uint4* dst = static_cast<uint4*>(s.e);
  for (int64_t i = blockIdx.y; i < s.n; i += gridDim.y) {
    const int64_t r = s.idx[i];
    const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
    for (int64_t j = tid; j < vecs; j += stride) dst[r * vecs + j] = src[i * vecs + j];
    for (int64_t t = tid; t < s.n_tiles; t += stride) {
      s.tile_sum[t * s.ld + r] = s.sum_redo[t * s.ld_redo + i];
      s.tile_max[t * s.ld + r] = s.max_redo[t * s.ld_redo + i];
      s.tile_arg[t * s.ld + r] = s.arg_redo[t * s.ld_redo + i];
    }
    if (tid == 0) s.ref[r] = s.ref_redo[i];
  }
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
  if ((p.row_bad == nullptr) != (p.row_max == nullptr)) return cudaErrorInvalidValue;
  const int64_t n = p.only_rows != nullptr ? p.n_only : p.ce.rows;
  if (n <= 0) return cudaSuccess;
  const dim3 block(kCombineRows, kCombineSlices);
  const unsigned grid = static_cast<unsigned>((n + kCombineRows - 1) / kCombineRows);
  CombineRefExpKernel<<<grid, block, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t LaunchCompactFlagged(const int32_t* row_bad, const float* row_max, int64_t c,
                                 int32_t* idx, float* ref_redo, int64_t ref_len,
                                 unsigned int* counts, cudaStream_t stream) {
  if (c < 0 || ref_len < 0) return cudaErrorInvalidValue;
  CompactFlaggedKernel<<<1, kCompactThreads, 0, stream>>>(row_bad, row_max, c, idx, ref_redo,
                                                          ref_len, counts);
  return cudaGetLastError();
}

cudaError_t LaunchGatherRows(const void* src, const int32_t* idx, int64_t n, int64_t cols,
                             void* dst, cudaStream_t stream) {
  if (cols % 8 != 0) return cudaErrorInvalidValue;
  if (n <= 0 || cols == 0) return cudaSuccess;
  const int64_t vecs = cols / 8;
  const dim3 grid(static_cast<unsigned>(std::min<int64_t>((vecs + 255) / 256, 64)),
                  static_cast<unsigned>(std::min<int64_t>(n, 65535)));
  GatherRowsKernel<<<grid, 256, 0, stream>>>(static_cast<const uint4*>(src), idx, n, vecs,
                                             static_cast<uint4*>(dst));
  return cudaGetLastError();
}

cudaError_t LaunchScatterRedo(const RefExpScatter& s, cudaStream_t stream) {
  if (s.v % 8 != 0 || s.ld_redo < s.n) return cudaErrorInvalidValue;
  if (s.n <= 0) return cudaSuccess;
  const int64_t work = std::max(s.v / 8, s.n_tiles);
  const dim3 grid(static_cast<unsigned>(std::min<int64_t>((work + 255) / 256, 64)),
                  static_cast<unsigned>(std::min<int64_t>(s.n, 65535)));
  ScatterRedoKernel<<<grid, 256, 0, stream>>>(s);
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
