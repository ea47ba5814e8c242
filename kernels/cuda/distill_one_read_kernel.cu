// SPDX-License-Identifier: Apache-2.0
// The one-read distill kernel (row_loss_kernels.h's distill math) and its launch; LaunchRowLoss
// (row_loss_kernels.cu) picks it where row_loss_launch.h's RowLossCluster says it applies. A row
// is split over a cluster of blocks as in cross-entropy's one-read kernel, each block staging
// its segment of the student's row and of the teacher's in shared memory (16-byte asynchronous
// copies). Two exchanges through distributed shared memory, each combined in the same fixed
// order in every block: the two heads' statistics (hence both lse), then the segments' sums
// of the divergence and of d_j (hence sum d). Each block then writes its segment's gradient
// from shared memory: both rows are read from global memory once, where the two-pass kernel
// (distill_kernel.cu) reads the student's three times and the teacher's twice.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cmath>
#include <cstdint>

#include "kernels/cuda/ce_device.cuh"
#include "kernels/cuda/ce_kernels.h"
#include "kernels/cuda/one_read_device.cuh"
#include "kernels/cuda/row_loss_device.cuh"
#include "kernels/cuda/row_loss_kernels.h"
#include "kernels/cuda/row_loss_launch.h"

namespace lossd {
namespace cuda {
namespace {

// A block's statistics for the first exchange: the student's max, sum of exp(z - max) and
// first column of the max; the teacher's max and sum.
struct HeadsShare {
  float m, s;
  int best_j;
  float tm, ts;
};

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// Combines (m, s) of the 32 lanes, every lane the same result: the max, each s rescaled to it
// once, then butterfly sums (commutative steps: both lanes of a pair compute the same bits).
// With best_j: the first column of the max over the lanes that hold it.
__device__ __forceinline__ void WarpMaxSum(float& m, float& s, int* best_j) {
  float mm = m;
#pragma unroll
  for (int mask = 16; mask > 0; mask >>= 1) mm = fmaxf(mm, __shfl_xor_sync(0xffffffffu, mm, mask));
  // A lane that saw nothing has m = -inf and s = 0; skip it so -inf - -inf never makes a NaN.
  float ss = m == -INFINITY ? 0.0f : Mul(s, expf(Sub(m, mm)));
  int jj = best_j != nullptr && m == mm ? *best_j : 0x7fffffff;
#pragma unroll
  for (int mask = 16; mask > 0; mask >>= 1) {
    ss = Add(ss, __shfl_xor_sync(0xffffffffu, ss, mask));
    jj = min(jj, __shfl_xor_sync(0xffffffffu, jj, mask));
  }
  m = mm, s = ss;
  if (best_j != nullptr) *best_j = jj;
}

__device__ __forceinline__ float2 WarpSum2(float2 x) {
#pragma unroll
  for (int mask = 16; mask > 0; mask >>= 1) {
    x.x = Add(x.x, __shfl_xor_sync(0xffffffffu, x.x, mask));
    x.y = Add(x.y, __shfl_xor_sync(0xffffffffu, x.y, mask));
  }
  return x;
}

// One head's running (m, s) over 8 final logits x; with best_j, the student's argmax too (a
// strictly greater max, in increasing j, replaces it: the first index wins ties).
__device__ __forceinline__ void Absorb8(const float (&x)[8], int j, float& m, float& s,
                                        int* best_j) {
  float vmax = x[0];
#pragma unroll
  for (int k = 1; k < 8; ++k) vmax = fmaxf(vmax, x[k]);
  if (vmax > m) {
    if (best_j != nullptr) {
      int kb = 0;
#pragma unroll
      for (int k = 7; k >= 0; --k) kb = x[k] == vmax ? k : kb;
      *best_j = j + kb;
    }
    s = m == -INFINITY ? 0.0f : Mul(s, expf(Sub(m, vmax)));
    m = vmax;
  }
  const float m2 = Mul(m, kLog2e);
#pragma unroll
  for (int k = 0; k < 8; ++k) s = Add(s, Exp2Ftz(fmaf(x[k], kLog2e, -m2)));
}
#endif

// Two blocks a multiprocessor at least (64 KB of shared memory each in bf16): the divergence's
// element terms hold more registers than the cross-entropy's.
template <typename T>
__global__ void __launch_bounds__(kOneReadThreads, 2)
    OneReadDistillKernel(const RowLossParams p, int32_t seg_cols, int cluster) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  namespace cg = cooperative_groups;
  extern __shared__ __align__(16) unsigned char seg_raw[];
  T* seg = reinterpret_cast<T*>(seg_raw);  // the student's segment, then the teacher's
  T* tseg = seg + seg_cols;
  __shared__ HeadsShare warps[kOneReadWarps];
  __shared__ HeadsShare share;
  __shared__ float2 warp_sums[kOneReadWarps];
  __shared__ float2 sums;
  __shared__ float coef[3];
  constexpr int kVec = 8;
  constexpr int kStride = kOneReadThreads * kVec;
  constexpr int kIters = static_cast<int>(kDistillOneReadSegCols) / kStride;
  static_assert(kIters * kStride == kDistillOneReadSegCols, "a segment is whole strides");
  cg::cluster_group cl = cg::this_cluster();
  const int rank = static_cast<int>(cl.block_rank());
  const int64_t row = blockIdx.x / cluster;
  const int32_t v = static_cast<int32_t>(p.v);
  const int32_t c0 = rank * seg_cols;
  const int32_t n = c0 < v ? min(v - c0, seg_cols) : 0;
  T* z = static_cast<T*>(p.logits) + row * p.v + c0;
  const T* zt = static_cast<const T*>(p.teacher_logits) + row * p.v + c0;
  const T* bias = static_cast<const T*>(p.bias);
  const T* tbias = static_cast<const T*>(p.teacher_bias);
  const bool counts = p.targets[row] >= 0;
  const float inv_t = p.inv_temperature;
  const int j_first = threadIdx.x * kVec;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;

#pragma unroll
  for (int i = 0; i < kIters; ++i) {
    const int j0 = j_first + i * kStride;
    if (j0 < n) {
      CopyAsync16(seg + j0, z + j0, kVec * static_cast<int>(sizeof(T)));
      CopyAsync16(tseg + j0, zt + j0, kVec * static_cast<int>(sizeof(T)));
    }
    CommitAsyncGroup();
  }

  // z = (u + b) / T of 8 elements of one head's segment (Scaled's bits).
  auto scaled8 = [&](const T* src, const T* b, int j0, float (&x)[kVec]) {
    LoadVec<T, kVec>(src + j0, x);
    if (b != nullptr) {
      float bb[kVec];
      LoadVec<T, kVec>(b + c0 + j0, bb);
#pragma unroll
      for (int k = 0; k < kVec; ++k) x[k] = Add(x[k], bb[k]);
    }
#pragma unroll
    for (int k = 0; k < kVec; ++k) x[k] = Mul(x[k], inv_t);
  };

  // 1. Both heads' statistics, each vector as soon as it has arrived.
  float m = -INFINITY, s = 0.0f, tm = -INFINITY, ts = 0.0f;
  int best_j = 0x7fffffff;
#pragma unroll
  for (int i = 0; i < kIters; ++i) {
    const int j0 = j_first + i * kStride;
    if (j0 >= n) break;
    WaitAsyncGroupsAtMost(kIters - 1 - i);
    float x[kVec];
    scaled8(seg, bias, j0, x);
    Absorb8(x, c0 + j0, m, s, &best_j);
    scaled8(tseg, tbias, j0, x);
    Absorb8(x, c0 + j0, tm, ts, nullptr);
  }
  WarpMaxSum(m, s, &best_j);
  WarpMaxSum(tm, ts, nullptr);
  if (lane == 0) warps[warp] = HeadsShare{m, s, best_j, tm, ts};
  __syncthreads();
  if (warp == 0) {
    HeadsShare w{-INFINITY, 0.0f, 0x7fffffff, -INFINITY, 0.0f};
    if (lane < kOneReadWarps) w = warps[lane];
    WarpMaxSum(w.m, w.s, &w.best_j);
    WarpMaxSum(w.tm, w.ts, nullptr);
    if (lane == 0) share = w;
  }
  if (warp == 0) {
    ClusterArriveRelease();
  } else {
    ClusterArriveRelaxed();
  }
  ClusterWait();
  if (warp == 0) {
    // Lane r takes block r's statistics; the same fixed combination in every block.
    HeadsShare w{-INFINITY, 0.0f, 0x7fffffff, -INFINITY, 0.0f};
    if (lane < cluster) w = *cl.map_shared_rank(&share, lane);
    WarpMaxSum(w.m, w.s, &w.best_j);
    WarpMaxSum(w.tm, w.ts, nullptr);
    if (lane == 0) {
      coef[0] = Add(w.m, logf(w.s));
      coef[1] = Add(w.tm, logf(w.ts));
      if (rank == 0 && p.row_pred != nullptr) {
        p.row_pred[row] = w.best_j == 0x7fffffff ? 0 : w.best_j;
      }
    }
  }
  __syncthreads();
  const float lse = coef[0], tlse = coef[1];

  // 2. The segment's sums of the divergence's terms and of d_j, then the cluster's.
  float2 acc = make_float2(0.0f, 0.0f);
  if (counts) {
    for (int j0 = j_first; j0 < n; j0 += kStride) {
      float x[kVec], y[kVec];
      scaled8(seg, bias, j0, x);
      scaled8(tseg, tbias, j0, y);
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        const float2 d = Divergence(p.jsd_beta, Sub(x[k], lse), Sub(y[k], tlse));
        acc.x = Add(acc.x, d.x);
        acc.y = Add(acc.y, d.y);
      }
    }
  }
  acc = WarpSum2(acc);
  if (lane == 0) warp_sums[warp] = acc;
  __syncthreads();
  if (warp == 0) {
    acc = WarpSum2(lane < kOneReadWarps ? warp_sums[lane] : make_float2(0.0f, 0.0f));
    if (lane == 0) sums = acc;
  }
  if (warp == 0) {
    ClusterArriveRelease();
  } else {
    ClusterArriveRelaxed();
  }
  ClusterWait();
  if (warp == 0) {
    acc = WarpSum2(lane < cluster ? *cl.map_shared_rank(&sums, lane) : make_float2(0.0f, 0.0f));
    if (lane == 0) {
      if (rank == 0) {
        p.row_lse[row] = lse;
        p.row_logp[row] = counts ? acc.x : 0.0f;
        p.row_entropy[row] = 0.0f;
      }
      coef[2] = acc.y;
    }
  }
  // Done reading the other blocks' shared memory: a block leaves only once all have arrived.
  ClusterArriveRelaxed();
  __syncthreads();

  // 3. g_j = c (d_j - Q_j sum d) / T from shared memory, as DistillKernel.
  if (p.write_grad) {
    const float c = counts ? p.distill_coef : 0.0f;
    const float d_sum = coef[2];
    const float scale = Mul(c, inv_t);
    for (int j0 = j_first; j0 < n; j0 += kStride) {
      float g[kVec] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
      if (c != 0.0f) {
        float x[kVec], y[kVec];
        scaled8(seg, bias, j0, x);
        scaled8(tseg, tbias, j0, y);
#pragma unroll
        for (int k = 0; k < kVec; ++k) {
          const float log_q = Sub(x[k], lse);
          const float dj = Divergence(p.jsd_beta, log_q, Sub(y[k], tlse)).y;
          g[k] = Mul(scale, fmaf(-expf(log_q), d_sum, dj));
        }
      }
      StoreVec<T, kVec>(z + j0, g);
    }
  }
  ClusterWait();
#endif
}

template <typename T>
cudaError_t LaunchT(const RowLossParams& p, int cluster, cudaStream_t stream) {
  static std::atomic<uint64_t> ready{0};
  auto* kernel = OneReadDistillKernel<T>;
  const cudaError_t e =
      PrepareClusterKernel(kernel, 2 * kDistillOneReadSegCols * sizeof(T), &ready);
  if (e != cudaSuccess) return e;
  const int64_t seg_cols = OneReadSegmentCols(p.v, cluster);
  const OneReadLaunch l(static_cast<unsigned>(p.rows * cluster), cluster,
                        2 * static_cast<size_t>(seg_cols) * sizeof(T), stream);
  return cudaLaunchKernelEx(&l.cfg, kernel, p, static_cast<int32_t>(seg_cols), cluster);
}

}  // namespace

cudaError_t LaunchDistillOneRead(const RowLossParams& p, int cluster, cudaStream_t stream) {
  switch (p.elem) {
    case kElemBF16:
      return LaunchT<__nv_bfloat16>(p, cluster, stream);
    case kElemF16:
      return LaunchT<__half>(p, cluster, stream);
    case kElemF32:
      return LaunchT<float>(p, cluster, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace cuda
}  // namespace lossd
