// The logprob / policy row kernel (row_loss_kernels.h): one block per row, two reads of the
// row (statistics, then the gradient), as the cross-entropy's two-pass kernel.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "kernels/cuda/ce_device.cuh"
#include "kernels/cuda/ce_kernels.h"
#include "kernels/cuda/row_loss_kernels.h"
#include "kernels/cuda/softcap_tanh.h"

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
};

__device__ __forceinline__ Stats Empty() {
  return Stats{-INFINITY, 0.0f, 0.0f, -INFINITY, 0x7fffffff};
}

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

__device__ __forceinline__ Stats Shuffle(const Stats& a, int mask) {
  Stats r;
  r.m = __shfl_xor_sync(0xffffffffu, a.m, mask);
  r.s = __shfl_xor_sync(0xffffffffu, a.s, mask);
  r.q = __shfl_xor_sync(0xffffffffu, a.q, mask);
  r.best = __shfl_xor_sync(0xffffffffu, a.best, mask);
  r.best_j = __shfl_xor_sync(0xffffffffu, a.best_j, mask);
  return r;
}

// A fixed butterfly within warps, then warp 0 over the warps: the same tree every run.
__device__ Stats Reduce(Stats x, Stats* shared) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int mask = 16; mask > 0; mask >>= 1) x = Merge(x, Shuffle(x, mask));
  if (lane == 0) shared[warp] = x;
  __syncthreads();
  if (warp == 0) {
    x = lane < kWarps ? shared[lane] : Empty();
#pragma unroll
    for (int mask = 16; mask > 0; mask >>= 1) x = Merge(x, Shuffle(x, mask));
    if (lane == 0) shared[kWarps] = x;
  }
  __syncthreads();
  return shared[kWarps];
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

// Policy's dloss/dlogp_i of one row (policy_reference.h's PolicyRow), in double.
constexpr int32_t kPolicyCispo = 4;  // lossd::PolicyLossType::kCispo
constexpr int32_t kPolicySapo = 5;   // lossd::PolicyLossType::kSapo

__device__ double PolicyCoefficient(const RowLossParams& p, int64_t i, double logp) {
  const double a = p.advantages[i];
  const double r = p.old_logp != nullptr ? exp(logp - static_cast<double>(p.old_logp[i])) : 1.0;
  double dl;
  if (p.loss_type == kPolicyCispo) {  // the weight min(r, eps_high) is detached
    dl = -fmin(r, static_cast<double>(p.epsilon_high)) * a;
  } else if (p.loss_type == kPolicySapo) {
    const double tau = a > 0 ? p.sapo_temperature_pos : p.sapo_temperature_neg;
    const double x = tau * (r - 1.0);
    dl = -4.0 * a * r / ((1.0 + exp(-x)) * (1.0 + exp(x)));  // -4 A r g (1 - g)
  } else {
    const double lo = 1.0 - static_cast<double>(p.epsilon_low);
    const double hi = 1.0 + static_cast<double>(p.epsilon_high);
    const bool clipped = (r < lo && a < 0) || (r > hi && a > 0);
    // delta's cap (delta > hi) matters only where min picks the capped r A: A < 0.
    const bool capped = p.delta != 0.0f && r >= static_cast<double>(p.delta) && a < 0;
    // torch's gradient on a bound: clamp passes none, min splits its tie into halves.
    const double share = clipped || capped ? 0.0 : (r == lo || r == hi) ? 0.5 : 1.0;
    dl = -share * a * r;
  }
  if (p.beta != 0.0f && p.ref_logp != nullptr) {
    const double d = static_cast<double>(p.ref_logp[i]) - logp;
    double dkl = 1.0 - exp(d);
    if (p.use_bias_correction_kl != 0) dkl = (dkl + (exp(d) - d - 1.0)) * r;  // (k3 r)'
    dl += static_cast<double>(p.beta) * dkl;
  }
  return dl;
}

template <typename T>
__global__ void __launch_bounds__(kThreads) RowLossKernel(RowLossParams p) {
  __shared__ Stats shared[kWarps + 1];
  __shared__ float coef[2];
  const int64_t i = blockIdx.x;
  T* row = static_cast<T*>(p.logits) + i * p.v;
  const int t = p.targets[i];
  const float inv_cap = InverseOf(p.softcap);
  float chain = 0.0f;
  Stats st = Empty();
  for (int64_t j = threadIdx.x; j < p.v; j += kThreads) {
    Add1(st, Logit<T>(p, row, j, inv_cap, &chain), static_cast<int>(j));
  }
  st = Reduce(st, shared);
  const float log_s = logf(st.s);
  const float lse = Add(st.m, log_s);
  const float entropy = Sub(log_s, st.q / st.s);
  if (threadIdx.x == 0) {
    float logp = 0.0f, c = 0.0f, e = 0.0f;
    if (t >= 0) {
      logp = Sub(Logit<T>(p, row, t, inv_cap, &chain), lse);
      if (p.kind == kRowLossPolicy) {
        const float w = p.row_weight[i];
        if (w != 0.0f) c = static_cast<float>(w * PolicyCoefficient(p, i, logp));
      } else {
        c = p.coef_logp != nullptr ? p.coef_logp[i] : 0.0f;
        e = p.coef_entropy != nullptr ? p.coef_entropy[i] : 0.0f;
      }
    }
    p.row_lse[i] = lse;
    p.row_logp[i] = logp;
    p.row_entropy[i] = t >= 0 ? entropy : 0.0f;
    if (p.row_pred != nullptr) p.row_pred[i] = st.best_j;
    coef[0] = c;
    coef[1] = e;
  }
  if (!p.write_grad) return;
  __syncthreads();
  const float c = coef[0], e = coef[1];
  if (t < 0 || (c == 0.0f && e == 0.0f)) {
    for (int64_t j = threadIdx.x; j < p.v; j += kThreads) row[j] = FromFloat<T>(0.0f);
    return;
  }
  // Every thread has read its own elements only, so each may overwrite them now.
  for (int64_t j = threadIdx.x; j < p.v; j += kThreads) {
    const float z = Logit<T>(p, row, j, inv_cap, &chain);
    const float pj = expf(Sub(z, lse));
    float g = Mul(c, j == t ? Sub(1.0f, pj) : -pj);
    if (e != 0.0f) g = fmaf(-Mul(e, pj), Add(Sub(z, lse), entropy), g);
    row[j] = FromFloat<T>(Mul(g, chain));
  }
}

// Sums of two values over the block, in a fixed tree (as Reduce).
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

template <typename T>
__global__ void __launch_bounds__(kThreads) DistillKernel(RowLossParams p) {
  __shared__ Stats shared[kWarps + 1];
  __shared__ float2 sums[kWarps + 1];
  const int64_t i = blockIdx.x;
  T* row = static_cast<T*>(p.logits) + i * p.v;
  const T* trow = static_cast<const T*>(p.teacher_logits) + i * p.v;
  const bool counts = p.targets[i] >= 0;
  const float inv_t = p.inv_temperature;
  Stats st = Empty(), tt = Empty();
  for (int64_t j = threadIdx.x; j < p.v; j += kThreads) {
    Add1(st, Scaled<T>(row, p.bias, j, inv_t), static_cast<int>(j));
    Add1(tt, Scaled<T>(trow, p.teacher_bias, j, inv_t), static_cast<int>(j));
  }
  st = Reduce(st, shared);
  tt = Reduce(tt, shared);
  const float lse = Add(st.m, logf(st.s)), tlse = Add(tt.m, logf(tt.s));
  float2 acc = make_float2(0.0f, 0.0f);
  if (counts) {
    for (int64_t j = threadIdx.x; j < p.v; j += kThreads) {
      const float log_q = Sub(Scaled<T>(row, p.bias, j, inv_t), lse);
      const float log_p = Sub(Scaled<T>(trow, p.teacher_bias, j, inv_t), tlse);
      const float2 t = Divergence(p.jsd_beta, log_q, log_p);
      acc.x = Add(acc.x, t.x);
      acc.y = Add(acc.y, t.y);
    }
  }
  acc = SumReduce(acc, sums);
  if (threadIdx.x == 0) {
    p.row_lse[i] = lse;
    p.row_logp[i] = counts ? acc.x : 0.0f;
    p.row_entropy[i] = 0.0f;
    if (p.row_pred != nullptr) p.row_pred[i] = st.best_j;
  }
  if (!p.write_grad) return;
  const float c = counts ? p.distill_coef : 0.0f;
  const float d_sum = acc.y;
  const float scale = Mul(c, inv_t);
  // Each thread rewrites only the elements it read itself.
  for (int64_t j = threadIdx.x; j < p.v; j += kThreads) {
    float g = 0.0f;
    if (c != 0.0f) {
      const float log_q = Sub(Scaled<T>(row, p.bias, j, inv_t), lse);
      const float log_p = Sub(Scaled<T>(trow, p.teacher_bias, j, inv_t), tlse);
      const float dj = Divergence(p.jsd_beta, log_q, log_p).y;
      g = Mul(scale, fmaf(-expf(log_q), d_sum, dj));
    }
    row[j] = FromFloat<T>(g);
  }
}

}  // namespace

cudaError_t LaunchRowLoss(const RowLossParams& p, cudaStream_t stream) {
  if (p.rows <= 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>(p.rows));
  if (p.kind == kRowLossDistill) {
    switch (p.elem) {
      case kElemBF16:
        DistillKernel<__nv_bfloat16><<<grid, kThreads, 0, stream>>>(p);
        break;
      case kElemF16:
        DistillKernel<__half><<<grid, kThreads, 0, stream>>>(p);
        break;
      default:
        DistillKernel<float><<<grid, kThreads, 0, stream>>>(p);
        break;
    }
    return cudaGetLastError();
  }
  switch (p.elem) {
    case kElemBF16:
      RowLossKernel<__nv_bfloat16><<<grid, kThreads, 0, stream>>>(p);
      break;
    case kElemF16:
      RowLossKernel<__half><<<grid, kThreads, 0, stream>>>(p);
      break;
    default:
      RowLossKernel<float><<<grid, kThreads, 0, stream>>>(p);
      break;
  }
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace lossd
