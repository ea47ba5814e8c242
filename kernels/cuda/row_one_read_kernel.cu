// SPDX-License-Identifier: Apache-2.0
// The one-read logprob / policy kernel (row_loss_kernels.h's math) and its launch; LaunchRowLoss
// (row_loss_kernels.cu) picks it where row_loss_launch.h's RowLossCluster says it applies. As
// cross-entropy's one-read kernel (one_read_kernel.cu): a row is split over a cluster of
// blocks, each staging its segment in shared memory with 16-byte asynchronous copies; the blocks
// exchange their statistics (max, sum of exponentials, the entropy's sum, the argmax, the
// target's logit) through distributed shared memory and combine them in the same fixed order,
// so every block gets the same lse, entropy and coefficients, and each writes its segment's
// gradient from shared memory. The row is read from global memory once, where the two-pass
// kernel (row_loss_kernels.cu) reads it twice with scalar loads.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "kernels/cuda/ce_device.cuh"
#include "kernels/cuda/ce_kernels.h"
#include "kernels/cuda/one_read_device.cuh"
#include "kernels/cuda/row_loss_device.cuh"
#include "kernels/cuda/row_loss_kernels.h"
#include "kernels/cuda/row_loss_launch.h"
#include "kernels/cuda/softcap_tanh.h"

namespace lossd {
namespace cuda {
namespace {

// A block's segment statistics, read by the other blocks of the cluster: the max m of the final
// logits z, s = sum exp(z - m), q = sum exp(z - m)(z - m), the first column holding m, and the
// target's z (written by the block whose segment holds it).
struct RowShare {
  float m, s, q;
  int best_j;
  float zt;
};

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// Combines the (m, s, q, best_j) of the 32 lanes; every lane gets the same result: the max
// first, each lane's s and q rescaled to it once (as row_loss_device.cuh's Rescale), then
// butterfly sums and a min. Every step is commutative, so the two lanes of a pair compute the
// same bits and the order is fixed: deterministic.
__device__ __forceinline__ void WarpCombineQ(float& m, float& s, float& q, int& best_j) {
  float mm = m;
#pragma unroll
  for (int mask = 16; mask > 0; mask >>= 1) mm = fmaxf(mm, __shfl_xor_sync(0xffffffffu, mm, mask));
  float ss = 0.0f, qq = 0.0f;
  if (m != -INFINITY) {  // a lane that saw nothing: -inf - -inf would be a NaN
    const float d = Sub(m, mm);
    const float f = expf(d);
    ss = Mul(s, f);
    qq = Mul(f, fmaf(d, s, q));
  }
  int jj = m == mm ? best_j : 0x7fffffff;
#pragma unroll
  for (int mask = 16; mask > 0; mask >>= 1) {
    ss = Add(ss, __shfl_xor_sync(0xffffffffu, ss, mask));
    qq = Add(qq, __shfl_xor_sync(0xffffffffu, qq, mask));
    jj = min(jj, __shfl_xor_sync(0xffffffffu, jj, mask));
  }
  m = mm, s = ss, q = qq, best_j = jj;
}
#endif

// kCap: softcap on; kEnt: the entropy's upstream gradient may be nonzero (logprob's or
// policy's coef_entropy), else e_i = 0 and its term is left out. At least three blocks a multiprocessor
// (64 KB of shared memory each in bf16), as cross-entropy's one-read kernel, except with kEnt:
// its gradient loop needs about 56 registers, and bound to 40 it spilled 84-220 bytes a thread
// (ptxas), so it runs two. The bias and an ignored row are decided once a block, outside the
// loops; the argmax and the target are checked once per 8 elements.
template <typename T, bool kCap, bool kEnt>
__global__ void __launch_bounds__(kOneReadThreads, kEnt ? 2 : 3)
    OneReadRowLossKernel(const RowLossParams p, int32_t seg_cols, int cluster) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  namespace cg = cooperative_groups;
  using No = std::integral_constant<bool, false>;
  using Yes = std::integral_constant<bool, true>;
  extern __shared__ __align__(16) unsigned char seg_raw[];
  T* seg = reinterpret_cast<T*>(seg_raw);
  __shared__ RowShare warps[kOneReadWarps];
  __shared__ RowShare share;
  __shared__ float coef[4];
  constexpr int kVec = 8;
  constexpr int kStride = kOneReadThreads * kVec;
  constexpr int kIters = static_cast<int>(kRowOneReadSegCols) / kStride;
  static_assert(kIters * kStride == kRowOneReadSegCols, "a segment is whole strides");
  cg::cluster_group cl = cg::this_cluster();
  const int rank = static_cast<int>(cl.block_rank());
  const int64_t row = blockIdx.x / cluster;
  const int32_t v = static_cast<int32_t>(p.v);
  const int32_t c0 = rank * seg_cols;
  const int32_t n = c0 < v ? min(v - c0, seg_cols) : 0;
  T* z = static_cast<T*>(p.logits) + row * p.v + c0;
  const T* bias = static_cast<const T*>(p.bias);
  const float cap = p.softcap, inv_cap = InverseOf(cap), inv_t = p.inv_temperature;
  const int t = p.targets[row];
  const int t_local = t - c0;  // the target's column within the segment (may be outside it)
  const int j_first = threadIdx.x * kVec;

  // The segment, global to shared memory: every copy of the thread in flight at once, one
  // group per vector, so the statistics of each start as soon as it has arrived. Each thread
  // reads back only what it copied itself, so waiting for its own groups is enough.
#pragma unroll
  for (int i = 0; i < kIters; ++i) {
    const int j0 = j_first + i * kStride;
    if (j0 < n) CopyAsync16(seg + j0, z + j0, kVec * static_cast<int>(sizeof(T)));
    CommitAsyncGroup();
  }

  // Final logits of 8 elements, z = softcap(u + b) / T (Logit's bits); with kCap, th gets the
  // tanh for the chain factor.
  auto logits8 = [&](int j0, float (&x)[kVec], float (&th)[kVec], auto has_bias) {
    LoadVec<T, kVec>(seg + j0, x);
    if constexpr (decltype(has_bias)::value) {
      float b[kVec];
      LoadVec<T, kVec>(bias + c0 + j0, b);
#pragma unroll
      for (int k = 0; k < kVec; ++k) x[k] = Add(x[k], b[k]);
    }
    if constexpr (kCap) {
      SoftcapTanhVec(x, inv_cap);
#pragma unroll
      for (int k = 0; k < kVec; ++k) th[k] = x[k], x[k] = Mul(cap, x[k]);
    }
#pragma unroll
    for (int k = 0; k < kVec; ++k) x[k] = Mul(x[k], inv_t);
  };

  // The thread's statistics; a strictly greater max, in increasing j, replaces the argmax, so
  // the first index wins ties.
  float m = -INFINITY, s = 0.0f, q = 0.0f, m2 = -INFINITY;  // m2 = m log2(e)
  int best_j = 0x7fffffff;
  auto stats = [&](auto has_bias) {
#pragma unroll
    for (int i = 0; i < kIters; ++i) {
      const int j0 = j_first + i * kStride;
      if (j0 >= n) break;
      WaitAsyncGroupsAtMost(kIters - 1 - i);  // this thread's vector i has arrived
      float x[kVec], th[kVec];
      logits8(j0, x, th, has_bias);
      float vmax = x[0];
#pragma unroll
      for (int k = 1; k < kVec; ++k) vmax = fmaxf(vmax, x[k]);
      if (vmax > m) {
        int kb = 0;
#pragma unroll
        for (int k = kVec - 1; k >= 0; --k) kb = x[k] == vmax ? k : kb;
        best_j = c0 + j0 + kb;
        if (m == -INFINITY) {
          s = 0.0f, q = 0.0f;
        } else {
          const float d = Sub(m, vmax);
          const float f = expf(d);
          q = Mul(f, fmaf(d, s, q));
          s = Mul(s, f);
        }
        m = vmax;
        m2 = Mul(vmax, kLog2e);
      }
      if (static_cast<unsigned>(t_local - j0) < static_cast<unsigned>(kVec)) {
#pragma unroll
        for (int k = 0; k < kVec; ++k) {
          if (k == t_local - j0) share.zt = x[k];
        }
      }
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        const float e = Exp2Ftz(fmaf(x[k], kLog2e, -m2));
        s = Add(s, e);
        q = fmaf(e, Sub(x[k], m), q);
      }
    }
  };
  if (bias != nullptr) {
    stats(Yes{});
  } else {
    stats(No{});
  }

  // The block's statistics: each warp's, then warp 0 combines the warps'.
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  WarpCombineQ(m, s, q, best_j);
  if (lane == 0) warps[warp] = RowShare{m, s, q, best_j, 0.0f};
  __syncthreads();
  if (warp == 0) {
    m = -INFINITY, s = 0.0f, q = 0.0f, best_j = 0x7fffffff;
    if (lane < kOneReadWarps) {
      const RowShare w = warps[lane];
      m = w.m, s = w.s, q = w.q, best_j = w.best_j;
    }
    WarpCombineQ(m, s, q, best_j);
    if (lane == 0) share.m = m, share.s = s, share.q = q, share.best_j = best_j;
  }
  // Every block's share is visible cluster-wide past this barrier (warp 0 wrote it and, through
  // the block barrier, has seen the target's logit: its arrive releases, the others' are
  // relaxed, as in cross-entropy's kernel).
  if (warp == 0) {
    ClusterArriveRelease();
  } else {
    ClusterArriveRelaxed();
  }
  ClusterWait();
  if (warp == 0) {
    RowShare mine{-INFINITY, 0.0f, 0.0f, 0x7fffffff, 0.0f};
    if (lane < cluster) mine = *cl.map_shared_rank(&share, lane);
    const float zt = __shfl_sync(0xffffffffu, mine.zt, t >= 0 ? t / seg_cols : 0);
    float am = mine.m, as = mine.s, aq = mine.q;
    int aj = mine.best_j;
    WarpCombineQ(am, as, aq, aj);
    if (lane == 0) {
      const float log_s = logf(as);
      const float lse = Add(am, log_s);
      const float entropy = Sub(log_s, aq / as);
      float logp = 0.0f, c = 0.0f, e = 0.0f;
      if (t >= 0) {
        logp = Sub(zt, lse);
        if (p.kind == kRowLossPolicy) {
          const float w = p.row_weight[row];
          if (w != 0.0f) c = static_cast<float>(w * PolicyCoefficient(p, row, logp));
        } else {
          c = p.coef_logp != nullptr ? p.coef_logp[row] : 0.0f;
        }
        if constexpr (kEnt) e = p.coef_entropy[row];
      }
      if (rank == 0) {
        p.row_lse[row] = lse;
        p.row_logp[row] = logp;
        p.row_entropy[row] = t >= 0 ? entropy : 0.0f;
        if (p.row_pred != nullptr) p.row_pred[row] = aj == 0x7fffffff ? 0 : aj;
      }
      coef[0] = c, coef[1] = e, coef[2] = lse, coef[3] = entropy;
    }
  }
  // Done reading the other blocks' shares; a block leaves (and its shared memory goes) only once
  // every block has arrived here.
  ClusterArriveRelaxed();
  __syncthreads();
  const float c = coef[0], e = coef[1], lse = coef[2], entropy = coef[3];
  if (p.write_grad && (t < 0 || (c == 0.0f && e == 0.0f))) {
    const float zero[kVec] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    for (int j0 = j_first; j0 < n; j0 += kStride) StoreVec<T, kVec>(z + j0, zero);
  } else if (p.write_grad) {
    const float lse2 = Mul(lse, kLog2e);
    // g_j = [c ([j = t] - p_j) - e p_j (z_j - lse + H)] (1/T) softcap'(u_j), as RowLossKernel.
    auto grad_loop = [&](auto has_bias) {
      for (int j0 = j_first; j0 < n; j0 += kStride) {
        float x[kVec], th[kVec], g[kVec];
        logits8(j0, x, th, has_bias);
        auto grad = [&](int k, bool target) {
          const float pj = Exp2Ftz(fmaf(x[k], kLog2e, -lse2));
          float gk = Mul(c, target ? Sub(1.0f, pj) : -pj);
          if constexpr (kEnt) {
            gk = fmaf(-Mul(e, pj), Add(Sub(x[k], lse), entropy), gk);
          }
          float chain = inv_t;
          if constexpr (kCap) chain = Mul(fmaf(-th[k], th[k], 1.0f), inv_t);
          return Mul(gk, chain);
        };
#pragma unroll
        for (int k = 0; k < kVec; ++k) g[k] = grad(k, false);
        if (static_cast<unsigned>(t_local - j0) < static_cast<unsigned>(kVec)) {
#pragma unroll
          for (int k = 0; k < kVec; ++k) {
            if (k == t_local - j0) g[k] = grad(k, true);
          }
        }
        StoreVec<T, kVec>(z + j0, g);
      }
    };
    if (bias != nullptr) {
      grad_loop(Yes{});
    } else {
      grad_loop(No{});
    }
  }
  ClusterWait();
#endif
}

template <typename T, bool kCap, bool kEnt>
cudaError_t LaunchK(const RowLossParams& p, int cluster, cudaStream_t stream) {
  static std::atomic<uint64_t> ready{0};
  auto* kernel = OneReadRowLossKernel<T, kCap, kEnt>;
  const cudaError_t e = PrepareClusterKernel(kernel, kRowOneReadSegCols * sizeof(T), &ready);
  if (e != cudaSuccess) return e;
  const int64_t seg_cols = OneReadSegmentCols(p.v, cluster);
  const OneReadLaunch l(static_cast<unsigned>(p.rows * cluster), cluster,
                        static_cast<size_t>(seg_cols) * sizeof(T), stream);
  return cudaLaunchKernelEx(&l.cfg, kernel, p, static_cast<int32_t>(seg_cols), cluster);
}

template <typename T>
cudaError_t LaunchT(const RowLossParams& p, int cluster, cudaStream_t stream) {
  const bool cap = p.softcap > 0.0f;
  const bool ent =
      (p.kind == kRowLossLogprob || p.kind == kRowLossPolicy) && p.coef_entropy != nullptr;
  if (cap && ent) return LaunchK<T, true, true>(p, cluster, stream);
  if (cap) return LaunchK<T, true, false>(p, cluster, stream);
  if (ent) return LaunchK<T, false, true>(p, cluster, stream);
  return LaunchK<T, false, false>(p, cluster, stream);
}

}  // namespace

cudaError_t LaunchRowLossOneRead(const RowLossParams& p, int cluster, cudaStream_t stream) {
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
