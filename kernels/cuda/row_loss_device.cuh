// SPDX-License-Identifier: Apache-2.0
// Device helpers of the loss kinds' row kernels (row_loss_kernels.h's math): the online softmax
// statistics with the entropy's sum, their merge (reduced by ce_device.cuh's BlockReduce), an
// element's final logit and chain factor, policy's coefficient, distillation's element terms
// and a block sum of two values. The two-pass kernels (row_loss_kernels.cu,
// distill_kernel.cu) and the one-read kernels (row_one_read_kernel.cu,
// distill_one_read_kernel.cu) share them, so every kernel computes the same formulas.
// nvcc only; one copy per .cu in an anonymous namespace, as ce_device.cuh.
#ifndef LOSSD_KERNELS_CUDA_ROW_LOSS_DEVICE_CUH_
#define LOSSD_KERNELS_CUDA_ROW_LOSS_DEVICE_CUH_

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "kernels/cuda/ce_device.cuh"
#include "kernels/cuda/row_loss_kernels.h"
#include "kernels/cuda/softcap_tanh.h"
#include "kernels/policy_math.h"

namespace lossd {
namespace cuda {
namespace {

// Online softmax statistics of a set of final logits z, kept relative to their max m so the
// entropy has no cancellation against a large lse: s = sum exp(z - m), q = sum exp(z - m)(z - m).
// Then lse = m + log s and H = log s - q / s. Also the argmax (first index on ties).
struct Stats {
  float m, s, q;
  float best;
  int best_j;

  static __device__ __forceinline__ Stats Empty() {
    return Stats{-INFINITY, 0.0f, 0.0f, -INFINITY, 0x7fffffff};
  }
};

// a rescaled to the max `m` (m >= a.m): exp(a.m - m) (s, q + (a.m - m) s).
__device__ __forceinline__ void Rescale(const Stats& a, float m, float* s, float* q) {
  if (a.m == -INFINITY) {  // saw nothing: -inf - -inf would be a NaN
    *s = 0.0f;
    *q = 0.0f;
    return;
  }
  const float d = Sub(a.m, m);
  const float f = expf(d);
  *s = Mul(a.s, f);
  *q = Mul(f, fmaf(d, a.s, a.q));
}

__device__ __forceinline__ Stats Merge(const Stats& a, const Stats& b) {
  Stats r;
  r.m = fmaxf(a.m, b.m);
  float sa, qa, sb, qb;
  Rescale(a, r.m, &sa, &qa);
  Rescale(b, r.m, &sb, &qb);
  r.s = Add(sa, sb);
  r.q = Add(qa, qb);
  const bool take_b = b.best > a.best || (b.best == a.best && b.best_j < a.best_j);
  r.best = take_b ? b.best : a.best;
  r.best_j = take_b ? b.best_j : a.best_j;
  return r;
}

// One more element, with one exponential.
__device__ __forceinline__ void Add1(Stats& a, float z, int j) {
  if (z > a.best) {
    a.best = z;
    a.best_j = j;
  }
  if (z > a.m) {
    if (a.m == -INFINITY) {
      a.s = 1.0f;
      a.q = 0.0f;
    } else {
      const float d = Sub(a.m, z);
      const float f = expf(d);
      a.q = Mul(f, fmaf(d, a.s, a.q));
      a.s = fmaf(a.s, f, 1.0f);
    }
    a.m = z;
  } else {
    const float d = Sub(z, a.m);
    const float e = expf(d);
    a.s = Add(a.s, e);
    a.q = fmaf(e, d, a.q);
  }
}

// Element j's final logit z and the factor (1/T) softcap'(u) that takes dF/dz to dF/du.
template <typename T>
__device__ __forceinline__ float Logit(const RowLossParams& p, const T* row, int64_t j,
                                       float inv_cap, float* chain) {
  float u = ToFloat<T>(row[j]);
  if (p.bias != nullptr) u = Add(u, ToFloat<T>(static_cast<const T*>(p.bias)[j]));
  float z = u, d = 1.0f;
  if (p.softcap > 0.0f) {
    const float th = SoftcapTanh(Mul(u, inv_cap));
    z = Mul(p.softcap, th);
    d = fmaf(-th, th, 1.0f);
  }
  *chain = Mul(d, p.inv_temperature);
  return Mul(z, p.inv_temperature);
}

// Policy's dloss/dlogp_i of one row at token level (kernels/policy_math.h's Terms), in
// double; the entropy bonus's part comes as e_i.
__device__ double PolicyCoefficient(const RowLossParams& p, int64_t i, double logp) {
  const double r = p.old_logp != nullptr ? exp(logp - static_cast<double>(p.old_logp[i])) : 1.0;
  const double rho = p.is_ratio != nullptr ? static_cast<double>(p.is_ratio[i]) : 1.0;
  const bool has_ref = p.ref_logp != nullptr;
  const double ref = has_ref ? static_cast<double>(p.ref_logp[i]) : 0.0;
  return policy_math::Terms(p.policy, logp, 0.0, r, static_cast<double>(p.advantages[i]), rho,
                            has_ref, ref, false)
      .dlogp;
}

// Sums of two values over the block, in a fixed tree (as BlockReduce).
__device__ float2 SumReduce(float2 x, float2* shared) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int mask = 16; mask > 0; mask >>= 1) {
    x.x = Add(x.x, __shfl_xor_sync(0xffffffffu, x.x, mask));
    x.y = Add(x.y, __shfl_xor_sync(0xffffffffu, x.y, mask));
  }
  if (lane == 0) shared[warp] = x;
  __syncthreads();
  if (warp == 0) {
    x = lane < kWarps ? shared[lane] : make_float2(0.0f, 0.0f);
#pragma unroll
    for (int mask = 16; mask > 0; mask >>= 1) {
      x.x = Add(x.x, __shfl_xor_sync(0xffffffffu, x.x, mask));
      x.y = Add(x.y, __shfl_xor_sync(0xffffffffu, x.y, mask));
    }
    if (lane == 0) shared[kWarps] = x;
  }
  __syncthreads();
  return shared[kWarps];
}

// z = (u + b) / T of element j of a row (no softcap for distillation).
template <typename T>
__device__ __forceinline__ float Scaled(const T* row, const void* bias, int64_t j, float inv_t) {
  float u = ToFloat<T>(row[j]);
  if (bias != nullptr) u = Add(u, ToFloat<T>(static_cast<const T*>(bias)[j]));
  return Mul(u, inv_t);
}

// One element's divergence term and d_j = d row / d log Q_j (distill_reference.h's
// RowDivergence): log M from the larger of the two logs, so a tiny M never underflows to 0.
__device__ __forceinline__ float2 Divergence(float beta, float log_q, float log_p) {
  const float q = expf(log_q), pj = expf(log_p);
  if (beta == 0.0f) return make_float2(Mul(pj, Sub(log_p, log_q)), -pj);
  const float lq_lp = Sub(log_q, log_p);
  if (beta == 1.0f) return make_float2(Mul(q, lq_lp), Mul(q, Add(lq_lp, 1.0f)));
  const float m = fmaxf(log_p, log_q);
  const float log_m =
      Add(m, logf(Add(Mul(beta, expf(Sub(log_p, m))), Mul(Sub(1.0f, beta), expf(Sub(log_q, m))))));
  const float dq = Mul(Mul(Sub(1.0f, beta), q), Sub(log_q, log_m));
  return make_float2(fmaf(Mul(beta, pj), Sub(log_p, log_m), dq), dq);
}

}  // namespace
}  // namespace cuda
}  // namespace lossd

#endif  // LOSSD_KERNELS_CUDA_ROW_LOSS_DEVICE_CUH_
