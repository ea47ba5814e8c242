// SPDX-License-Identifier: Apache-2.0
// The fp32 arithmetic of one optimizer step for one element (kernels/optimizer.h), shared by
// the CPU backend and the CUDA kernel so both round alike: the same operations in the same
// order, each rounded to fp32 on its own. Never contracts a multiply and an add into an FMA.
#ifndef LOSSD_KERNELS_OPTIMIZER_MATH_H_
#define LOSSD_KERNELS_OPTIMIZER_MATH_H_

#include <cmath>
#include <cstdint>

#include "kernels/optimizer.h"

#if defined(__CUDACC__)
#define LOSSD_OPT_FN __host__ __device__ __forceinline__
#else
#define LOSSD_OPT_FN inline
#endif

namespace lossd {
namespace optimizer_math {

// The scalars of one step, computed in double as torch does in Python and rounded once to
// fp32, where torch's tensor op would round them.
struct Scalars {
  float scale = 1;  // grad_scale
  // SGD.
  float wd = 0;                   // (float)weight_decay
  float momentum = 0;             // (float)momentum
  float one_minus_dampening = 1;  // (float)(1 - dampening)
  float neg_lr = 0;               // (float)(-lr)
  // AdamW.
  float decay = 1;              // (float)(1 - lr*weight_decay)
  float lerp_weight = 0;        // (float)(1 - beta1): exp_avg.lerp_(grad, 1 - beta1)
  float beta2 = 0;              // (float)beta2
  float one_minus_beta2 = 0;    // (float)(1 - beta2)
  float bc2_sqrt = 1;           // (float)sqrt(1 - beta2^step)
  float eps = 0;                // (float)eps
  float neg_step_size = 0;      // (float)(-lr / (1 - beta1^step))
};

inline Scalars ScalarsOf(const OptimizerParams& p) {
  Scalars s;
  s.scale = p.grad_scale;
  s.wd = static_cast<float>(p.weight_decay);
  s.momentum = static_cast<float>(p.momentum);
  s.one_minus_dampening = static_cast<float>(1 - p.dampening);
  s.neg_lr = static_cast<float>(-p.lr);
  s.decay = static_cast<float>(1 - p.lr * p.weight_decay);
  s.lerp_weight = static_cast<float>(1 - p.beta1);
  s.beta2 = static_cast<float>(p.beta2);
  s.one_minus_beta2 = static_cast<float>(1 - p.beta2);
  const double step = static_cast<double>(p.step);
  s.bc2_sqrt = static_cast<float>(std::sqrt(1 - std::pow(p.beta2, step)));
  s.eps = static_cast<float>(p.eps);
  s.neg_step_size = static_cast<float>(-p.lr / (1 - std::pow(p.beta1, step)));
  return s;
}

// One rounding per operation. On the device the _rn intrinsics keep nvcc from fusing a
// multiply and an add into an FMA (which rounds once, not twice, and so differs in the last
// bit); the host build of every user is compiled with -ffp-contract=off for the same reason.
// sqrtf and the division are IEEE round-to-nearest on both (nvcc's default -prec-sqrt and
// -prec-div; the intrinsics make it explicit).
#if defined(__CUDA_ARCH__)
LOSSD_OPT_FN float Mul(float a, float b) { return __fmul_rn(a, b); }
LOSSD_OPT_FN float Add(float a, float b) { return __fadd_rn(a, b); }
LOSSD_OPT_FN float Sub(float a, float b) { return __fsub_rn(a, b); }
LOSSD_OPT_FN float Div(float a, float b) { return __fdiv_rn(a, b); }
LOSSD_OPT_FN float Sqrt(float a) { return __fsqrt_rn(a); }
#else
LOSSD_OPT_FN float Mul(float a, float b) { return a * b; }
LOSSD_OPT_FN float Add(float a, float b) { return a + b; }
LOSSD_OPT_FN float Sub(float a, float b) { return a - b; }
LOSSD_OPT_FN float Div(float a, float b) { return a / b; }
LOSSD_OPT_FN float Sqrt(float a) { return std::sqrt(a); }
#endif

// torch.maximum: a NaN in either operand wins.
LOSSD_OPT_FN float MaxPropagatingNan(float a, float b) {
  return (a != a || a > b) ? a : b;
}

// SGD for one element; buf may be null only when momentum is 0. Torch's order:
//   g = grad*scale; g = g + wd*p (wd != 0); buf = g (first step) or buf*momentum +
//   (1-dampening)*g; g = nesterov ? g + momentum*buf : buf; p = p + (-lr)*g.
LOSSD_OPT_FN void SgdElement(const Scalars& s, bool weight_decay, bool momentum, bool nesterov,
                             bool initialised, float* p, float grad, float* buf) {
  float g = Mul(grad, s.scale);
  if (weight_decay) g = Add(g, Mul(s.wd, *p));
  if (momentum) {
    const float b = initialised ? Add(Mul(*buf, s.momentum), Mul(s.one_minus_dampening, g)) : g;
    *buf = b;
    g = nesterov ? Add(g, Mul(s.momentum, b)) : b;
  }
  *p = Add(*p, Mul(s.neg_lr, g));
}

// AdamW for one element; vmax is read and written only with amsgrad. The order of torch's CPU
// kernels (its CUDA kernels contract products into FMAs and divide by a scalar through its
// reciprocal, so they differ from this, and from torch on the CPU, in the last bits):
//   p = p*(1-lr*wd); m = lerp(m, g, 1-beta1) (torch's lerp: m + w*(g-m) for w < 0.5, else
//   g - (g-m)*(1-w)); v = v*beta2 + ((1-beta2)*g)*g; vmax = max(vmax, v);
//   denom = sqrt(v or vmax)/sqrt(bc2) + eps; p = p + ((-lr/bc1)*m)/denom.
LOSSD_OPT_FN void AdamWElement(const Scalars& s, bool amsgrad, float* p, float grad, float* m,
                               float* v, float* vmax) {
  const float g = Mul(grad, s.scale);
  const float decayed = Mul(*p, s.decay);
  const float diff = Sub(g, *m);
  const float m_new = s.lerp_weight < 0.5f ? Add(*m, Mul(s.lerp_weight, diff))
                                           : Sub(g, Mul(diff, Sub(1.0f, s.lerp_weight)));
  const float v_new = Add(Mul(*v, s.beta2), Mul(Mul(s.one_minus_beta2, g), g));
  float second = v_new;
  if (amsgrad) {
    second = MaxPropagatingNan(*vmax, v_new);
    *vmax = second;
  }
  const float denom = Add(Div(Sqrt(second), s.bc2_sqrt), s.eps);
  *m = m_new;
  *v = v_new;
  *p = Add(decayed, Div(Mul(s.neg_step_size, m_new), denom));
}

// fp32 to bf16, round to nearest even, NaN kept a NaN: the bits core/dtype.h's FloatToBf16
// gives, written without absl so the device can use it.
LOSSD_OPT_FN uint16_t Bf16Bits(uint32_t bits) {
  if ((bits & 0x7f800000u) == 0x7f800000u && (bits & 0x007fffffu) != 0) {
    return static_cast<uint16_t>((bits >> 16) | 0x0040u);
  }
  return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

}  // namespace optimizer_math
}  // namespace lossd

#undef LOSSD_OPT_FN

#endif  // LOSSD_KERNELS_OPTIMIZER_MATH_H_
