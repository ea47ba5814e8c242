// SPDX-License-Identifier: Apache-2.0
// tanh in fp32 for the softcap, as the cross-entropy kernels compute it. CUDA's tanhf evaluates
// both of its forms for every element (a polynomial and an exponential with a reciprocal: about
// 17 instructions, two of them on the multi-function unit), and the softcap takes it twice an
// element (statistics, then gradient), which had made the softcap pass 1.9x the plain one. Here
// the polynomial alone serves |y| < kTanhNear, which with a softcap of 30 means every logit
// under 30 in magnitude; the kernels branch to the exponential form only where an element needs
// it. In a header of its own, and callable on the host, so that a CPU test can sweep the
// polynomial (it gives the same bits on both: fmaf and round-to-nearest products only) and the
// exponential form's formula; a GPU test sweeps both as the GPU computes them.
#ifndef LOSSD_KERNELS_CUDA_SOFTCAP_TANH_H_
#define LOSSD_KERNELS_CUDA_SOFTCAP_TANH_H_

#include <math.h>

#if defined(__CUDACC__)
#define LOSSD_HOST_DEVICE __host__ __device__
#else
#define LOSSD_HOST_DEVICE
#endif

namespace lossd {
namespace cuda {

// Where the polynomial ends. At |y| = 1 the exponential form's 2 / (e^{2|y|} + 1) term is 0.12,
// so its two approximate instructions (about an ulp each on the GPU) cost tanh less than 1.5 ulp
// there and less further out; a wider polynomial would need more terms.
constexpr float kTanhNear = 1.0f;

LOSSD_HOST_DEVICE inline float TanhMul(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);  // never contracted into an FMA, so the host gets the same bits
#else
  return a * b;
#endif
}

// tanh(y) for |y| < kTanhNear: y + y^3 P(y^2), P of degree 6 with coefficients fitted for the
// least maximum relative error of the result over [0, 1] with each coefficient rounded to fp32
// in turn (tools/fit_softcap_tanh.py): 4.7e-9 before the evaluation's own roundings, so the
// result is within an ulp of tanh (the CPU test measures it).
LOSSD_HOST_DEVICE inline float TanhNear(float y) {
  const float s = TanhMul(y, y);
  float p = -3.586266248e-4f;
  p = fmaf(p, s, 2.301974921e-3f);
  p = fmaf(p, s, -7.946942002e-3f);
  p = fmaf(p, s, 2.148722112e-2f);
  p = fmaf(p, s, -5.387999490e-2f);
  p = fmaf(p, s, 1.333234757e-1f);
  p = fmaf(p, s, -3.333329558e-1f);
  return fmaf(TanhMul(y, s), p, y);
}

// 2^x and 1 / x: one approximate multi-function instruction each on the GPU (flushing
// subnormal results to zero, which tanh never produces here), exact library calls on the host.
LOSSD_HOST_DEVICE inline float TanhExp2(float x) {
#if defined(__CUDA_ARCH__)
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
#else
  return exp2f(x);
#endif
}

LOSSD_HOST_DEVICE inline float TanhRcp(float x) {
#if defined(__CUDA_ARCH__)
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
#else
  return 1.0f / x;
#endif
}

// tanh(y) for |y| >= kTanhNear: sign(y) (1 - 2 / (e^{2|y|} + 1)). Past |y| = 44 the
// exponential is +inf, the reciprocal 0 and the result +-1 exactly; a NaN stays NaN.
LOSSD_HOST_DEVICE inline float TanhFar(float y) {
  const float e = TanhExp2(TanhMul(fabsf(y), 2.0f * 1.44269504088896341f));
  return copysignf(fmaf(-2.0f, TanhRcp(e + 1.0f), 1.0f), y);
}

// tanh(y), element by element the same bits as the kernels' branching over a vector of them.
LOSSD_HOST_DEVICE inline float SoftcapTanh(float y) {
  return fabsf(y) < kTanhNear ? TanhNear(y) : TanhFar(y);
}

}  // namespace cuda
}  // namespace lossd

#endif  // LOSSD_KERNELS_CUDA_SOFTCAP_TANH_H_
