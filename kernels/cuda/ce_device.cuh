// SPDX-License-Identifier: Apache-2.0
// Device helpers of the cross-entropy kernels (ce_kernels.cu, one_read_kernel.cu) and the small
// column kernels (column_kernels.cu): dtype conversion, vector loads and stores, the row
// statistics and their block reduction, uncontracted fp32 arithmetic, the softcap and the
// per-row gradient terms.
// nvcc only (device code); one copy per .cu, in an anonymous namespace as before the split, so
// every kernel compiles from the same source as it did.
#ifndef LOSSD_KERNELS_CUDA_CE_DEVICE_CUH_
#define LOSSD_KERNELS_CUDA_CE_DEVICE_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>

#include "kernels/cuda/ce_kernels.h"
#include "kernels/cuda/softcap_tanh.h"

namespace lossd {
namespace cuda {
namespace {

// One block per row. 512 threads keep 16 warps of 16-byte loads in flight per row while
// leaving room for two or more rows per multiprocessor.
constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr float kLog2e = 1.4426950408889634f;

template <typename T>
__device__ __forceinline__ float ToFloat(T x);
template <>
__device__ __forceinline__ float ToFloat<__nv_bfloat16>(__nv_bfloat16 x) {
  return __bfloat162float(x);
}
template <>
__device__ __forceinline__ float ToFloat<__half>(__half x) {
  return __half2float(x);
}
template <>
__device__ __forceinline__ float ToFloat<float>(float x) {
  return x;
}

template <typename T>
__device__ __forceinline__ T FromFloat(float x);
template <>
__device__ __forceinline__ __nv_bfloat16 FromFloat<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
template <>
__device__ __forceinline__ __half FromFloat<__half>(float x) {
  return __float2half_rn(x);
}
template <>
__device__ __forceinline__ float FromFloat<float>(float x) {
  return x;
}

// Eight consecutive elements as raw bits: one 16-byte word for 16-bit types, two for fp32.
template <typename T>
struct Raw8 {
  uint4 q[sizeof(T) / 2];
};

template <typename T>
__device__ __forceinline__ Raw8<T> LoadRaw(const T* p) {
  Raw8<T> r;
#pragma unroll
  for (int i = 0; i < static_cast<int>(sizeof(T) / 2); ++i) {
    r.q[i] = reinterpret_cast<const uint4*>(p)[i];
  }
  return r;
}

__device__ __forceinline__ uint32_t Word(const uint4& q, int i) {
  return i == 0 ? q.x : i == 1 ? q.y : i == 2 ? q.z : q.w;
}

template <typename T>
__device__ __forceinline__ T FromBits16(uint16_t b);
template <>
__device__ __forceinline__ __half FromBits16<__half>(uint16_t b) {
  return __ushort_as_half(b);
}

// The eight values widened to fp32, element k of the eight in x[k] (in memory order).
// bf16 is the top half of an fp32, so a pair takes two integer instructions (a shift and a
// mask), not the three of a 16-bit extract and a convert; the values are the same.
template <typename T>
__device__ __forceinline__ void Widen(const Raw8<T>& r, float (&x)[8]) {
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    if constexpr (sizeof(T) == 4) {
      x[k] = __uint_as_float(Word(r.q[k / 4], k % 4));
    } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      const uint32_t w = Word(r.q[0], k / 2);
      x[k] = __uint_as_float((k & 1) ? (w & 0xffff0000u) : (w << 16));
    } else {
      const uint32_t w = Word(r.q[0], k / 2);
      x[k] = ToFloat<T>(FromBits16<T>(static_cast<uint16_t>((k & 1) ? (w >> 16) : (w & 0xffffu))));
    }
  }
}

// Loads kVec consecutive elements starting at p, widened to fp32. With kVec == 8, p is
// 16-byte aligned: one 16-byte load for 16-bit types, two for fp32.
template <typename T, int kVec>
__device__ __forceinline__ void LoadVec(const T* p, float (&out)[kVec]) {
  if constexpr (kVec == 8) {
    Widen<T>(LoadRaw<T>(p), out);
  } else {
#pragma unroll
    for (int k = 0; k < kVec; ++k) out[k] = ToFloat<T>(p[k]);
  }
}

template <typename T, int kVec>
__device__ __forceinline__ void StoreVec(T* p, const float (&in)[kVec]) {
  if constexpr (kVec == 8 && sizeof(T) == 2) {
    uint4 raw;
    T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
    for (int k = 0; k < 8; ++k) e[k] = FromFloat<T>(in[k]);
    *reinterpret_cast<uint4*>(p) = raw;
  } else if constexpr (kVec == 8 && sizeof(T) == 4) {
    reinterpret_cast<float4*>(p)[0] = make_float4(in[0], in[1], in[2], in[3]);
    reinterpret_cast<float4*>(p)[1] = make_float4(in[4], in[5], in[6], in[7]);
  } else {
#pragma unroll
    for (int k = 0; k < kVec; ++k) p[k] = FromFloat<T>(in[k]);
  }
}

struct RowStats {
  float m;     // running max
  float s;     // sum of exp(z - m)
  float best;  // argmax value
  int best_j;  // argmax index (first on ties)
  float wz;    // sum_j cw_j z_j (label smoothing only)

  static __device__ __forceinline__ RowStats Empty() {
    return RowStats{-INFINITY, 0.0f, -INFINITY, 0x7fffffff, 0.0f};
  }
};

__device__ __forceinline__ RowStats Merge(const RowStats& a, const RowStats& b) {
  RowStats r;
  r.m = fmaxf(a.m, b.m);
  // A side that saw nothing has m = -inf and s = 0; skip it so -inf - -inf never makes a NaN.
  const float sa = a.m == -INFINITY ? 0.0f : a.s * exp2f((a.m - r.m) * kLog2e);
  const float sb = b.m == -INFINITY ? 0.0f : b.s * exp2f((b.m - r.m) * kLog2e);
  r.s = sa + sb;
  const bool take_b = b.best > a.best || (b.best == a.best && b.best_j < a.best_j);
  r.best = take_b ? b.best : a.best;
  r.best_j = take_b ? b.best_j : a.best_j;
  r.wz = a.wz + b.wz;
  return r;
}

// Every 32-bit word of a statistics record from lane (lane ^ mask): one template for every
// record type (RowStats here, the loss kinds' statistics in row_loss_device.cuh).
template <typename S>
__device__ __forceinline__ S ShuffleXor(const S& a, int mask) {
  static_assert(sizeof(S) % 4 == 0, "a record of 32-bit words");
  constexpr int kWords = static_cast<int>(sizeof(S) / 4);
  uint32_t w[kWords];
  memcpy(w, &a, sizeof(S));
#pragma unroll
  for (int k = 0; k < kWords; ++k) w[k] = __shfl_xor_sync(0xffffffffu, w[k], mask);
  S r;
  memcpy(&r, w, sizeof(S));
  return r;
}

// Fixed butterfly order within warps, then warp 0 over the warps' results: the same tree on
// every run, so the result is deterministic. S has Merge(S, S) (found by argument-dependent
// lookup) and S::Empty(), a record that saw nothing; shared holds kWarps + 1 records.
template <typename S>
__device__ S BlockReduce(S x, S* shared) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int mask = 16; mask > 0; mask >>= 1) x = Merge(x, ShuffleXor(x, mask));
  if (lane == 0) shared[warp] = x;
  __syncthreads();
  if (warp == 0) {
    x = lane < kWarps ? shared[lane] : S::Empty();
#pragma unroll
    for (int mask = 16; mask > 0; mask >>= 1) x = Merge(x, ShuffleXor(x, mask));
    if (lane == 0) shared[kWarps] = x;
  }
  __syncthreads();
  return shared[kWarps];
}

// The element formulas of both kernels say where an FMA goes (fmaf) and round every other
// product, sum and difference on its own (__fmul_rn and its kin are never contracted). Left
// to itself the compiler may fuse a p - sm cw either way round, and did so differently in the
// bf16 and the fp32 instantiation of the one-read kernel, which then disagreed in the last bit
// of about one gradient element in a million (GPU host, smoothing with softcap); the
// fp32-compute path must give the same bits for bf16 storage and for the same values in fp32.
__device__ __forceinline__ float Mul(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ float Add(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ float Sub(float a, float b) { return __fsub_rn(a, b); }

// The softcap: the final logit cap tanh(u / cap), computed as cap tanh(u (1 / cap)) the way the
// CPU backend has it (inv_cap = 1 / cap; an fp32 division is a dozen instructions and a call to
// its slow path), and its derivative 1 - tanh^2.
//
// SoftcapTanhVec: tanh(u_k / cap) over a thread's kVec elements, in place, each with the bits of
// SoftcapTanh (softcap_tanh.h): the polynomial alone unless one of them is at or past kTanhNear
// (with a softcap of 30, a logit of 30 or more in magnitude), and only then both forms. A
// branch on the thread's elements, not a select per element: the two-pass kernel is bound by
// its instructions, and with the select it was slower than with tanhf (H200, softcap 30,
// V = 256000: 6.21 against 5.62 ms; 4.77 ms with the branch, and the one-read kernel 3.73
// against 4.50 ms with tanhf, bench/RESULTS.md).
template <int kVec>
__device__ __forceinline__ void SoftcapTanhVec(float (&y)[kVec], float inv_cap) {
  bool far = false;
#pragma unroll
  for (int k = 0; k < kVec; ++k) {
    y[k] = Mul(y[k], inv_cap);
    far |= !(fabsf(y[k]) < kTanhNear);  // a NaN takes the exponential form, which keeps it
  }
  if (far) {
#pragma unroll
    for (int k = 0; k < kVec; ++k) y[k] = SoftcapTanh(y[k]);
  } else {
#pragma unroll
    for (int k = 0; k < kVec; ++k) y[k] = TanhNear(y[k]);
  }
}

// Final logit of one element from its stored value u (bias and softcap applied in fp32), with
// the same bits as SoftcapTanhVec's.
__device__ __forceinline__ float Capped(float u, float cap, float inv_cap) {
  return cap > 0.0f ? Mul(cap, SoftcapTanh(Mul(u, inv_cap))) : u;
}

__device__ __forceinline__ float InverseOf(float cap) { return cap > 0.0f ? 1.0f / cap : 0.0f; }

// The gradient of element j from its p_j: a p_j - hot [j == t] - sm cw_j (with smoothing),
// times the softcap's 1 - th^2 (with a softcap), in that order. The one-read kernel passes
// `smooth` and `cap` as template constants, which the inlining folds away.
__device__ __forceinline__ float GradOf(bool smooth, bool cap, float a, float pj, bool target,
                                        float hot, float sm, float cwj, float th) {
  float g = Mul(a, pj);
  if (target) g = Sub(g, hot);
  if (smooth) g = fmaf(-sm, cwj, g);
  if (cap) g = Mul(g, fmaf(-th, th, 1.0f));
  return g;
}

// The per-row results and gradient coefficients of a non-ignored row (t >= 0) from its lse,
// its target's final logit zt and the smoothing sum wz; both kernels use it, so they agree on
// every formula: g_j = a p_j - hot [j == t] - sm cw_j.
struct RowTerms {
  float ce, zl;      // the row's cross-entropy and z-loss
  float a, hot, sm;  // gradient coefficients
};

__device__ __forceinline__ RowTerms TermsOf(const CrossEntropyParams& p, int64_t row, int t,
                                            float lse, float zt, float wz) {
  const float eps = p.label_smoothing;
  const bool smooth = eps > 0.0f;
  const float cwt = p.class_weights != nullptr ? p.class_weights[t] : 1.0f;
  RowTerms r;
  const float keep = Sub(1.0f, eps), spread = eps / static_cast<float>(p.v);
  r.ce = Mul(Mul(keep, cwt), Sub(lse, zt));
  if (smooth) r.ce = Add(r.ce, Mul(spread, Sub(Mul(p.class_weight_sum, lse), wz)));
  r.zl = Mul(Mul(p.z_loss_scale, lse), lse);
  float rs = p.row_scale != nullptr ? p.row_scale[row] : 1.0f;
  if (p.token_scaling) {
    // s = p_t, rounded to the input dtype as torch.softmax rounds it: the row's loss, z-loss
    // and gradient coefficients take it here, so the gradient pass costs nothing more.
    const float e = expf(Sub(zt, lse));
    const float s = p.elem == kElemBF16  ? ToFloat(FromFloat<__nv_bfloat16>(e))
                    : p.elem == kElemF16 ? ToFloat(FromFloat<__half>(e))
                                         : e;
    r.ce = Mul(r.ce, s);
    r.zl = Mul(r.zl, s);
    rs = Mul(rs, s);
  }
  const float ce_s = Mul(p.ce_scale, rs), z_s = Mul(p.z_scale, rs);
  r.hot = Mul(Mul(ce_s, keep), cwt);
  r.a = Add(r.hot, Mul(Mul(Mul(z_s, 2.0f), p.z_loss_scale), lse));
  if (smooth) r.a = Add(r.a, Mul(Mul(ce_s, spread), p.class_weight_sum));
  r.sm = smooth ? Mul(ce_s, spread) : 0.0f;
  return r;
}

}  // namespace
}  // namespace cuda
}  // namespace lossd

#endif  // LOSSD_KERNELS_CUDA_CE_DEVICE_CUH_
