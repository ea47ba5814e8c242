// SPDX-License-Identifier: Apache-2.0
#include "kernels/cpu/optimizer_reference.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace lossd {
namespace {

void SgdStep(const OptimizerParams& p, int64_t n, double* param, const double* grad,
             double* buf) {
  const double scale = p.grad_scale;
  for (int64_t i = 0; i < n; ++i) {
    double g = grad[i] * scale;
    if (p.weight_decay != 0) g += p.weight_decay * param[i];
    if (p.momentum != 0) {
      // torch's buffer is None before the first step: it starts as a copy of the gradient,
      // with no dampening.
      buf[i] = p.momentum_initialised ? p.momentum * buf[i] + (1 - p.dampening) * g : g;
      g = p.nesterov ? g + p.momentum * buf[i] : buf[i];
    }
    param[i] -= p.lr * g;
  }
}

void AdamWStep(const OptimizerParams& p, int64_t n, double* param, const double* grad,
               double* m, double* v, double* vmax) {
  const double scale = p.grad_scale;
  const double step = static_cast<double>(p.step);
  const double bc1 = 1 - std::pow(p.beta1, step);
  const double bc2_sqrt = std::sqrt(1 - std::pow(p.beta2, step));
  const double step_size = p.lr / bc1;
  for (int64_t i = 0; i < n; ++i) {
    const double g = grad[i] * scale;
    param[i] *= 1 - p.lr * p.weight_decay;
    m[i] += (1 - p.beta1) * (g - m[i]);
    v[i] = p.beta2 * v[i] + (1 - p.beta2) * g * g;
    double second = v[i];
    if (p.amsgrad) {
      vmax[i] = std::max(vmax[i], v[i]);
      second = vmax[i];
    }
    const double denom = std::sqrt(second) / bc2_sqrt + p.eps;
    param[i] -= step_size * m[i] / denom;
  }
}

}  // namespace

void ReferenceOptimizerStep(const OptimizerParams& p, int64_t n, double* param,
                            const double* grad, double* s1, double* s2, double* s3) {
  switch (p.kind) {
    case OptimizerKind::kSgd:
      SgdStep(p, n, param, grad, s1);
      return;
    case OptimizerKind::kAdamW:
      AdamWStep(p, n, param, grad, s1, s2, s3);
      return;
  }
}

double ReferenceSumOfSquares(const float* x, int64_t n) {
  double sum = 0;
  for (int64_t i = 0; i < n; ++i) sum += static_cast<double>(x[i]) * x[i];
  return sum;
}

}  // namespace lossd
