// SPDX-License-Identifier: Apache-2.0
// The one-read cross-entropy kernel (ce_kernels.h's contract; chosen by LaunchCrossEntropy,
// ce_kernels.cu): a row split over a cluster of blocks that exchange their statistics through
// distributed shared memory, so each row is read from memory once. Its launch and the device's
// largest cluster live here too (the helpers the loss kinds' one-read kernels share with it in
// one_read_device.cuh). The kernel stays one __global__ function
// (about 210 lines): cutting it into device functions hands its register use and instruction
// order to the inliner, which its measured times and fixed summation order depend on.
#include "kernels/cuda/one_read_kernel.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <type_traits>

#include "kernels/cuda/ce_device.cuh"
#include "kernels/cuda/one_read_device.cuh"
#include "kernels/cuda/softcap_tanh.h"

namespace lossd {
namespace cuda {
namespace {

// One read of each row: the row is split over a cluster of K blocks (16 at most), each
// holding its segment of at most kOneReadSegCols columns in shared memory. Every block
// reduces its segment's statistics, the cluster's blocks exchange them through distributed
// shared memory and combine all K in the same fixed order (so every block gets the same lse),
// and each writes its segment's gradient from shared memory. The two-pass kernel
// (ce_kernels.cu) reads each row twice; at V = 256000 a row is 512 KB, too big to be still in
// L2 for the second read, so this one moves 2/3 of its bytes (3.84 -> 2.29 ms there on an H200,
// against 1.98 ms for a copy of the same bytes; bench/RESULTS.md).
// One cluster per row, three blocks per multiprocessor (64 KB of shared memory each): a
// persistent version with a prefetch buffer (one block per multiprocessor) and smaller
// segments (clusters of 16) both measured slower.

// A block's segment statistics and the facts the row outputs need, read by the other blocks of
// the cluster: the max m, the sum s of exp(z - m), the first column holding m, the smoothing
// sum, and the target's final logit (written by the block whose segment holds it).
struct SegmentShare {
  float m, s;
  int best_j;
  float wz;
  float zt;
};

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// Combines the (m, s, best_j, wz) of the 32 lanes; every lane gets the same result. The max
// first, then each s rescaled to it once, then plain sums and a min: three butterflies of one
// value each instead of five rounds of merging whole records. Every step is commutative, so the
// two lanes of a butterfly pair compute the same bits and the order is fixed: deterministic.
template <bool kSmooth>
__device__ __forceinline__ void WarpCombine(float& m, float& s, int& best_j, float& wz) {
  float mm = m;
#pragma unroll
  for (int mask = 16; mask > 0; mask >>= 1) mm = fmaxf(mm, __shfl_xor_sync(0xffffffffu, mm, mask));
  // A lane that saw nothing has m = -inf and s = 0; skip it so -inf - -inf never makes a NaN.
  float ss = m == -INFINITY ? 0.0f : s * exp2f((m - mm) * kLog2e);
  // The first column of the max, over the lanes that hold it.
  int jj = m == mm ? best_j : 0x7fffffff;
#pragma unroll
  for (int mask = 16; mask > 0; mask >>= 1) {
    ss += __shfl_xor_sync(0xffffffffu, ss, mask);
    jj = min(jj, __shfl_xor_sync(0xffffffffu, jj, mask));
  }
  if constexpr (kSmooth) {
#pragma unroll
    for (int mask = 16; mask > 0; mask >>= 1) wz += __shfl_xor_sync(0xffffffffu, wz, mask);
  }
  m = mm, s = ss, best_j = jj;
}
#endif

// kCap: softcap on; kSmooth: label smoothing on. Templated so that the common case (neither)
// spends about twelve instructions an element over both passes: the kernel issued one
// instruction a cycle on every scheduler at 31 an element (H200 counters), about as many
// cycles as the memory took, so the loops are kept to the exponentials and what feeds them.
// The bias and an ignored row are decided once a block, outside the loops; the argmax and the
// target are checked once per 8 elements.
// At least three blocks a multiprocessor (at most 40 registers a thread): the softcap variants
// took 43 to 59 and so ran two. With the bound they spill a few bytes and are 5-6% faster
// (H200, V = 256000: 6.86 -> 6.53 ms with softcap 30); the others are unchanged.
template <typename T, bool kCap, bool kSmooth>
__global__ void __launch_bounds__(kOneReadThreads, 3)
    OneReadCrossEntropyKernel(const CrossEntropyParams p, int32_t seg_cols, int cluster) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  namespace cg = cooperative_groups;
  using NoBias = std::integral_constant<bool, false>;
  using WithBias = std::integral_constant<bool, true>;
  extern __shared__ __align__(16) unsigned char seg_raw[];
  T* seg = reinterpret_cast<T*>(seg_raw);
  __shared__ SegmentShare warps[kOneReadWarps];
  __shared__ SegmentShare share;
  __shared__ float coef[4];
  constexpr int kVec = 8;
  constexpr int kStride = kOneReadThreads * kVec;
  cg::cluster_group cl = cg::this_cluster();
  const int rank = static_cast<int>(cl.block_rank());
  const int64_t row = blockIdx.x / cluster;
  const int32_t v = static_cast<int32_t>(p.v);
  const int32_t c0 = rank * seg_cols;
  const int32_t n = c0 < v ? min(v - c0, seg_cols) : 0;
  T* z = static_cast<T*>(p.logits) + row * p.v + c0;
  const T* bias = static_cast<const T*>(p.bias);
  const float* cw = p.class_weights;
  const float cap = p.softcap;
  const float inv_cap = InverseOf(cap);
  const int t = p.targets[row];
  const int t_local = t - c0;  // the target's column within the segment (may be outside it)
  const int j_first = threadIdx.x * kVec;

  // The segment, global to shared memory asynchronously: every load of the thread is in flight
  // at once, and none takes a register. Each thread reads back only what it copied, so waiting
  // for its own copies is enough (no barrier). One group per 16-byte vector of the thread (a
  // segment is kIters strides of the block), always kIters groups, empty ones past the end:
  // the statistics of each vector start as soon as it has arrived.
  constexpr int kIters = static_cast<int>(kOneReadSegCols) / kStride;
  static_assert(kIters * kStride == kOneReadSegCols, "a segment is whole strides");
#pragma unroll
  for (int i = 0; i < kIters; ++i) {
    const int j0 = j_first + i * kStride;
    if (j0 < n) {
#pragma unroll
      for (int q = 0; q < static_cast<int>(sizeof(T) / 2); ++q) {
        const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(seg + j0)) + 16 * q;
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst),
                     "l"(reinterpret_cast<const char*>(z + j0) + 16 * q)
                     : "memory");
      }
    }
    asm volatile("cp.async.commit_group;\n" ::: "memory");
  }

  // 8 elements as stored, plus the bias where there is one (before the softcap).
  auto stored8 = [&](int j0, float (&x)[kVec], auto has_bias) {
    LoadVec<T, kVec>(seg + j0, x);
    if constexpr (decltype(has_bias)::value) {
      float b[kVec];
      LoadVec<T, kVec>(bias + c0 + j0, b);
#pragma unroll
      for (int k = 0; k < kVec; ++k) x[k] += b[k];
    }
  };
  // Final logits of 8 elements: stored value, plus bias, through the softcap.
  auto final8 = [&](int j0, float (&x)[kVec], auto has_bias) {
    stored8(j0, x, has_bias);
    if constexpr (kCap) {
      SoftcapTanhVec(x, inv_cap);
#pragma unroll
      for (int k = 0; k < kVec; ++k) x[k] = Mul(cap, x[k]);
    }
  };

  // The thread's statistics: max, sum of exp(z - max), the first column of the max (a
  // strictly greater max, in increasing j, replaces it: the first index wins ties), smoothing sum.
  float m = -INFINITY, s = 0.0f, wz = 0.0f;
  int best_j = 0x7fffffff;
  float m2 = -INFINITY;  // m * log2(e)
  auto stats = [&](auto has_bias) {
#pragma unroll
    for (int i = 0; i < kIters; ++i) {
      const int j0 = j_first + i * kStride;
      if (j0 >= n) break;
      WaitAsyncGroupsAtMost(kIters - 1 - i);  // this thread's vector i has arrived
      float x[kVec];
      final8(j0, x, has_bias);
      float vmax = x[0];
#pragma unroll
      for (int k = 1; k < kVec; ++k) vmax = fmaxf(vmax, x[k]);
      if (vmax > m) {
        int kb = 0;
#pragma unroll
        for (int k = kVec - 1; k >= 0; --k) kb = x[k] == vmax ? k : kb;
        best_j = c0 + j0 + kb;
        s = m == -INFINITY ? 0.0f : s * exp2f((m - vmax) * kLog2e);
        m = vmax;
        m2 = vmax * kLog2e;
      }
      if (static_cast<unsigned>(t_local - j0) < static_cast<unsigned>(kVec)) {
#pragma unroll
        for (int k = 0; k < kVec; ++k) {
          if (k == t_local - j0) share.zt = x[k];
        }
      }
#pragma unroll
      for (int k = 0; k < kVec; ++k) s += Exp2Ftz(fmaf(x[k], kLog2e, -m2));
      if constexpr (kSmooth) {
#pragma unroll
        for (int k = 0; k < kVec; ++k) wz = fmaf(cw != nullptr ? cw[c0 + j0 + k] : 1.0f, x[k], wz);
      }
    }
  };
  if (bias != nullptr) {
    stats(WithBias{});
  } else {
    stats(NoBias{});
  }

  // The block's statistics: each warp's, then warp 0 combines the warps'.
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  WarpCombine<kSmooth>(m, s, best_j, wz);
  if (lane == 0) warps[warp] = SegmentShare{m, s, best_j, wz, 0.0f};
  __syncthreads();
  if (warp == 0) {
    m = -INFINITY, s = 0.0f, best_j = 0x7fffffff, wz = 0.0f;
    if (lane < kOneReadWarps) {
      const SegmentShare w = warps[lane];
      m = w.m, s = w.s, best_j = w.best_j, wz = w.wz;
    }
    WarpCombine<kSmooth>(m, s, best_j, wz);
    if (lane == 0) share.m = m, share.s = s, share.best_j = best_j, share.wz = wz;
  }
  // Every block's share is written and visible cluster-wide past this barrier. Warp 0 wrote it
  // (and, through the block barrier above, has seen the target's logit another warp wrote), so
  // warp 0's arrive releases; the other warps' arrives are relaxed, sparing them the release's
  // wait for all their memory operations to land (measured: a tenth of the stall cycles).
  if (warp == 0) {
    ClusterArriveRelease();
  } else {
    ClusterArriveRelaxed();
  }
  ClusterWait();
  if (warp == 0) {
    // Lane r fetches block r's share (all at once), and the lanes combine them in the same
    // fixed order in every block of the cluster, so every block gets the same lse.
    SegmentShare mine{-INFINITY, 0.0f, 0x7fffffff, 0.0f, 0.0f};
    if (lane < cluster) mine = *cl.map_shared_rank(&share, lane);
    const float zt = __shfl_sync(0xffffffffu, mine.zt, t >= 0 ? t / seg_cols : 0);
    float am = mine.m, as = mine.s, awz = mine.wz;
    int aj = mine.best_j;
    WarpCombine<kSmooth>(am, as, aj, awz);
    if (lane == 0) {
      const float lse = am + logf(as);
      RowTerms r{0.0f, 0.0f, 0.0f, 0.0f, 0.0f};  // ignored rows: zeros
      if (t >= 0) r = TermsOf(p, row, t, lse, zt, awz);
      if (rank == 0) {
        p.row_lse[row] = lse;
        p.row_ce[row] = r.ce;
        p.row_z[row] = r.zl;
        p.row_pred[row] = aj == 0x7fffffff ? 0 : aj;
      }
      coef[0] = r.a, coef[1] = r.hot, coef[2] = r.sm, coef[3] = lse;
    }
  }
  // Done reading the other blocks' shares (their values are in registers, consumed above); a
  // block leaves, and its shared memory goes, only once every block has arrived here. Relaxed:
  // nothing written before this point is read through the barrier, so the release's wait for
  // this block's global stores to land is not needed.
  ClusterArriveRelaxed();
  __syncthreads();
  if (p.write_grad) {
    if (t < 0) {
      // An ignored row: a zero gradient.
      const float zero[kVec] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
      for (int j0 = j_first; j0 < n; j0 += kStride) StoreVec<T, kVec>(z + j0, zero);
    } else {
      const float a = coef[0], hot = coef[1], sm = coef[2], lse2 = coef[3] * kLog2e;
      auto grad_loop = [&](auto has_bias) {
        for (int j0 = j_first; j0 < n; j0 += kStride) {
          float u[kVec], g[kVec];
          stored8(j0, u, has_bias);
          if constexpr (kCap) SoftcapTanhVec(u, inv_cap);  // u now holds the tanh
          // g_j = (a p_j - hot [j == t] - sm cw_j) softcap'(u_j), in that order.
          auto grad = [&](int k, bool target) {
            float x = u[k], th = 0.0f;
            if constexpr (kCap) th = u[k], x = Mul(cap, th);
            const float cwj = kSmooth && cw != nullptr ? cw[c0 + j0 + k] : 1.0f;
            return GradOf(kSmooth, kCap, a, Exp2Ftz(fmaf(x, kLog2e, -lse2)), target, hot, sm,
                          cwj, th);
          };
#pragma unroll
          for (int k = 0; k < kVec; ++k) g[k] = grad(k, false);
          if (static_cast<unsigned>(t_local - j0) < static_cast<unsigned>(kVec)) {
            // The target's element once more, with the one-hot term: checked once per 8
            // elements instead of once per element.
#pragma unroll
            for (int k = 0; k < kVec; ++k) {
              if (k == t_local - j0) g[k] = grad(k, true);
            }
          }
          StoreVec<T, kVec>(z + j0, g);
        }
      };
      if (bias != nullptr) {
        grad_loop(WithBias{});
      } else {
        grad_loop(NoBias{});
      }
    }
  }
  ClusterWait();
#endif
}


// The one-read kernel's function attributes on the current device, set once per device (bit d
// of `ready`), not on every launch; two threads may both set them the first time, harmlessly.
template <typename T, bool kCap, bool kSmooth>
cudaError_t PrepareOneRead() {
  auto* kernel = OneReadCrossEntropyKernel<T, kCap, kSmooth>;
  static std::atomic<uint64_t> ready{0};
  int device = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e != cudaSuccess) return e;
  const uint64_t bit = device >= 0 && device < 64 ? uint64_t{1} << device : 0;
  if (bit != 0 && (ready.load(std::memory_order_acquire) & bit) != 0) return cudaSuccess;
  // Non-portable cluster sizes (Hopper places 16).
  e = cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
  if (e != cudaSuccess) return e;
  e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           static_cast<int>(kOneReadSegCols * sizeof(T)));
  if (e != cudaSuccess) return e;
  // As much of the unified L1 as shared memory as can be: three blocks of 64 KB a
  // multiprocessor.
  e = cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                           cudaSharedmemCarveoutMaxShared);
  if (e != cudaSuccess) return e;
  ready.fetch_or(bit, std::memory_order_release);
  return cudaSuccess;
}

template <typename T, bool kCap, bool kSmooth>
cudaError_t LaunchOneReadK(const CrossEntropyParams& p, int cluster, cudaStream_t stream) {
  const cudaError_t e = PrepareOneRead<T, kCap, kSmooth>();
  if (e != cudaSuccess) return e;
  const int64_t seg_cols = OneReadSegmentCols(p.v, cluster);
  const OneReadLaunch l(static_cast<unsigned>(p.rows * cluster), cluster,
                        static_cast<size_t>(seg_cols) * sizeof(T), stream);
  return cudaLaunchKernelEx(&l.cfg, OneReadCrossEntropyKernel<T, kCap, kSmooth>, p,
                            static_cast<int32_t>(seg_cols), cluster);
}

template <typename T>
cudaError_t LaunchOneReadT(const CrossEntropyParams& p, int cluster, cudaStream_t stream) {
  const bool cap = p.softcap > 0.0f, smooth = p.label_smoothing > 0.0f;
  if (cap && smooth) return LaunchOneReadK<T, true, true>(p, cluster, stream);
  if (cap) return LaunchOneReadK<T, true, false>(p, cluster, stream);
  if (smooth) return LaunchOneReadK<T, false, true>(p, cluster, stream);
  return LaunchOneReadK<T, false, false>(p, cluster, stream);
}

}  // namespace

// The largest cluster of one-read blocks the current device runs: 0 before compute
// capability 9.0 (no clusters), else 8 (the portable size), or 16 where the device can place a
// cluster of 16 of them; asked once per device.
int DeviceMaxCluster() {
  constexpr int kDevices = 64;
  static std::atomic<int> known[kDevices] = {};  // 0: not asked yet; else the answer + 1
  int device = 0, major = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0) return 0;
  if (device < kDevices) {
    const int k = known[device].load(std::memory_order_relaxed);
    if (k > 0) return k - 1;
  }
  int best = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) == cudaSuccess &&
      major >= 9) {
    best = 8;
    if (PrepareOneRead<__nv_bfloat16, false, false>() == cudaSuccess) {
      // 64 clusters of 16 blocks, each with the widest 16-bit segment.
      const OneReadLaunch l(16 * 64, 16, static_cast<size_t>(kOneReadSegCols) * 2, nullptr);
      auto* kernel = OneReadCrossEntropyKernel<__nv_bfloat16, false, false>;
      int clusters = 0;
      if (cudaOccupancyMaxActiveClusters(&clusters, kernel, &l.cfg) == cudaSuccess &&
          clusters > 0) {
        best = 16;
      }
    }
    cudaGetLastError();  // a refused query leaves no error behind for the next launch
  }
  if (device < kDevices) known[device].store(best + 1, std::memory_order_relaxed);
  return best;
}

cudaError_t LaunchOneRead(const CrossEntropyParams& p, int cluster, cudaStream_t stream) {
  switch (p.elem) {
    case kElemBF16:
      return LaunchOneReadT<__nv_bfloat16>(p, cluster, stream);
    case kElemF16:
      return LaunchOneReadT<__half>(p, cluster, stream);
    case kElemF32:
      return LaunchOneReadT<float>(p, cluster, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace cuda
}  // namespace lossd
