// SPDX-License-Identifier: Apache-2.0
// Device code of the fused linear + cross-entropy; see ce_kernels.h for the math and contract.
// The two-pass cross-entropy kernel, and the launcher that picks it or the one-read kernel
// (one_read_kernel.cu); the helpers both share are in ce_device.cuh, the column sum and cast
// kernels in column_kernels.cu. Each kernel stays one __global__ function: cutting a kernel
// into device functions hands its register use and instruction order to the inliner, which
// the measured times and the fixed summation order depend on.
#include "kernels/cuda/ce_kernels.h"
#include "kernels/cuda/softcap_tanh.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/ce_device.cuh"
#include "kernels/cuda/one_read_kernel.h"

namespace lossd {
namespace cuda {
namespace {

// kCap: softcap on, a template constant as in the one-read kernel: decided at run time, the
// softcap's code cost the plain pass 17% (H200, V = 256000: 4.31 ms; 3.44 ms as a constant,
// 3.70 ms before the softcap had its own tanh).
template <typename T, int kVec, bool kCap>
__global__ void __launch_bounds__(kThreads) CrossEntropyKernel(const CrossEntropyParams p) {
  __shared__ RowStats shared[kWarps + 1];
  __shared__ float coef[4];
  const int64_t row = blockIdx.x;
  const int64_t v = p.v;
  // The row's blocks: one contiguous run, or the blocked layout's runs in column order.
  const int nseg = p.segments > 0 ? p.segments : 1;
  auto seg_ptr = [&](int s) -> T* {
    return p.segments > 0 ? static_cast<T*>(p.seg_base[s]) + row * p.seg_cols[s]
                          : static_cast<T*>(p.logits) + row * v;
  };
  auto seg_col0 = [&](int s) -> int64_t { return p.segments > 0 ? p.seg_col0[s] : 0; };
  auto seg_cols = [&](int s) -> int64_t { return p.segments > 0 ? p.seg_cols[s] : v; };
  const T* bias = static_cast<const T*>(p.bias);
  const float* cw = p.class_weights;
  const float cap = p.softcap;
  const float inv_cap = InverseOf(cap);
  const float eps = p.label_smoothing;
  const bool smooth = eps > 0.0f;
  const int t = p.targets[row];
  const int64_t stride = static_cast<int64_t>(kThreads) * kVec;

  // Pass 1: online max / sum of exp, argmax and the smoothing sum, one read of the row.
  RowStats st{-INFINITY, 0.0f, -INFINITY, 0x7fffffff, 0.0f};
  for (int s = 0; s < nseg; ++s) {
    const T* z = seg_ptr(s);
    const int64_t c0 = seg_col0(s), n = seg_cols(s);
    for (int64_t j0 = static_cast<int64_t>(threadIdx.x) * kVec; j0 < n; j0 += stride) {
      float x[kVec];
      LoadVec<T, kVec>(z + j0, x);
      if (bias != nullptr) {
        float b[kVec];
        LoadVec<T, kVec>(bias + c0 + j0, b);
#pragma unroll
        for (int k = 0; k < kVec; ++k) x[k] += b[k];
      }
      if constexpr (kCap) {
        SoftcapTanhVec(x, inv_cap);
#pragma unroll
        for (int k = 0; k < kVec; ++k) x[k] = Mul(cap, x[k]);
      }
      float vmax = -INFINITY;
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        vmax = fmaxf(vmax, x[k]);
        if (x[k] > st.best) {  // strict, in increasing j: the first index wins ties
          st.best = x[k];
          st.best_j = static_cast<int>(c0 + j0 + k);
        }
      }
      if (vmax > st.m) {
        st.s = st.m == -INFINITY ? 0.0f : st.s * exp2f((st.m - vmax) * kLog2e);
        st.m = vmax;
      }
#pragma unroll
      for (int k = 0; k < kVec; ++k) st.s += exp2f((x[k] - st.m) * kLog2e);
      if (smooth) {
#pragma unroll
        for (int k = 0; k < kVec; ++k) {
          st.wz = fmaf(cw != nullptr ? cw[c0 + j0 + k] : 1.0f, x[k], st.wz);
        }
      }
    }
  }
  st = BlockReduce(st, shared);

  if (threadIdx.x == 0) {
    const float lse = st.m + logf(st.s);
    float ce = 0.0f, zl = 0.0f;
    if (t >= 0) {
      int ts = 0;
      while (ts + 1 < nseg && seg_col0(ts + 1) <= t) ++ts;
      float zt = ToFloat<T>(seg_ptr(ts)[t - seg_col0(ts)]);
      if (bias != nullptr) zt += ToFloat<T>(bias[t]);
      if constexpr (kCap) zt = Capped(zt, cap, inv_cap);
      const RowTerms r = TermsOf(p, row, t, lse, zt, st.wz);
      ce = r.ce;
      zl = r.zl;
      coef[0] = r.a;
      coef[1] = r.hot;
      coef[2] = r.sm;
    }
    coef[3] = lse;
    p.row_lse[row] = lse;
    p.row_ce[row] = ce;
    p.row_z[row] = zl;
    p.row_pred[row] = st.best_j == 0x7fffffff ? 0 : st.best_j;
  }
  if (!p.write_grad) return;
  __syncthreads();

  // Pass 2: the gradient over the same elements, in place. Ignored rows get zeros.
  const float lse = coef[3];
  const float a = coef[0], hot = coef[1], sm = coef[2];
  for (int s = 0; s < nseg; ++s) {
    T* z = seg_ptr(s);
    const int64_t c0 = seg_col0(s), n = seg_cols(s);
    for (int64_t j0 = static_cast<int64_t>(threadIdx.x) * kVec; j0 < n; j0 += stride) {
      float g[kVec];
      if (t < 0) {
#pragma unroll
        for (int k = 0; k < kVec; ++k) g[k] = 0.0f;
      } else {
        LoadVec<T, kVec>(z + j0, g);
        if (bias != nullptr) {
          float b[kVec];
          LoadVec<T, kVec>(bias + c0 + j0, b);
#pragma unroll
          for (int k = 0; k < kVec; ++k) g[k] += b[k];
        }
        if constexpr (kCap) SoftcapTanhVec(g, inv_cap);  // g now holds the tanh
#pragma unroll
        for (int k = 0; k < kVec; ++k) {
          float th = 0.0f, x = g[k];
          if constexpr (kCap) th = g[k], x = Mul(cap, th);
          const float pj = exp2f((x - lse) * kLog2e);
          const float cwj = smooth && cw != nullptr ? cw[c0 + j0 + k] : 1.0f;
          g[k] = GradOf(smooth, kCap, a, pj, c0 + j0 + k == t, hot, sm, cwj, th);
        }
      }
      StoreVec<T, kVec>(z + j0, g);
    }
  }
}


template <typename T>
cudaError_t LaunchCrossEntropyT(const CrossEntropyParams& p, cudaStream_t stream) {
  const int cluster = CrossEntropyCluster(p);
  if (cluster > 0) return LaunchOneRead(p, cluster, stream);
  // The 8-wide path needs every row start 16-byte aligned for every dtype alike (V % 8 == 0),
  // so the choice, and with it the summation order, depends on V alone.
  bool aligned = reinterpret_cast<uintptr_t>(p.bias) % 16 == 0;
  if (p.segments > 0) {
    // Blocked rows: every block's rows 16-byte aligned too (each block but the first is a
    // multiple of 64 columns wide, so this still depends on V alone for a given layout).
    for (int s = 0; s < p.segments; ++s) {
      aligned = aligned && reinterpret_cast<uintptr_t>(p.seg_base[s]) % 16 == 0 &&
                p.seg_cols[s] % 8 == 0 && p.seg_col0[s] % 8 == 0;
    }
  } else {
    aligned = aligned && reinterpret_cast<uintptr_t>(p.logits) % 16 == 0;
  }
  const dim3 grid(static_cast<unsigned>(p.rows));
  const bool cap = p.softcap > 0.0f;
  if (p.v % 8 == 0 && aligned) {
    if (cap) {
      CrossEntropyKernel<T, 8, true><<<grid, kThreads, 0, stream>>>(p);
    } else {
      CrossEntropyKernel<T, 8, false><<<grid, kThreads, 0, stream>>>(p);
    }
  } else if (cap) {
    CrossEntropyKernel<T, 1, true><<<grid, kThreads, 0, stream>>>(p);
  } else {
    CrossEntropyKernel<T, 1, false><<<grid, kThreads, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

}  // namespace

int CrossEntropyMaxCluster() { return DeviceMaxCluster(); }

int CrossEntropyCluster(const CrossEntropyParams& p) {
  // Contiguous rows, 16-byte aligned for every dtype alike (V % 8 == 0), so that, as for the
  // two-pass kernel's 8-wide path, the choice depends on V (and the GPU) alone.
  if (p.two_pass != 0 || p.segments != 0 || p.v % 8 != 0 || p.v <= 0) return 0;
  if (reinterpret_cast<uintptr_t>(p.logits) % 16 != 0 ||
      reinterpret_cast<uintptr_t>(p.bias) % 16 != 0) {
    return 0;
  }
  if (p.one_read_cols < 0 || p.one_read_cols % 8 != 0 || p.one_read_cols > kOneReadSegCols) {
    return 0;
  }
  const int64_t cols = p.one_read_cols > 0 ? p.one_read_cols : kOneReadSegCols;
  const int64_t cluster = (p.v + cols - 1) / cols;
  if (cluster > 16 || p.rows * cluster > 0x7fffffff) return 0;
  return cluster <= DeviceMaxCluster() ? static_cast<int>(cluster) : 0;
}

cudaError_t LaunchCrossEntropy(const CrossEntropyParams& p, cudaStream_t stream) {
  if (p.rows <= 0) return cudaSuccess;
  if (p.rows > 0x7fffffff || p.v > 0x7fffffff) return cudaErrorInvalidValue;
  if (p.segments < 0 || p.segments > kMaxSegments) return cudaErrorInvalidValue;
  switch (p.elem) {
    case kElemBF16:
      return LaunchCrossEntropyT<__nv_bfloat16>(p, stream);
    case kElemF16:
      return LaunchCrossEntropyT<__half>(p, stream);
    case kElemF32:
      return LaunchCrossEntropyT<float>(p, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace cuda
}  // namespace lossd
