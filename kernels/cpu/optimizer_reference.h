// SPDX-License-Identifier: Apache-2.0
// The float64 oracle of one optimizer step (kernels/optimizer.h): torch.optim.SGD and
// torch.optim.AdamW's single-tensor update, every value and scalar in double. It never
// validates (callers pass a checked OptimizerParams) and never rounds to fp32.
#ifndef LOSSD_KERNELS_CPU_OPTIMIZER_REFERENCE_H_
#define LOSSD_KERNELS_CPU_OPTIMIZER_REFERENCE_H_

#include <cstdint>

#include "kernels/optimizer.h"

namespace lossd {

// One step over n elements, in place. The gradient is first multiplied by p.grad_scale.
//   SGD:   g += wd*param (coupled); with momentum: buf = g when !momentum_initialised, else
//          buf = momentum*buf + (1-dampening)*g; g = nesterov ? g + momentum*buf : buf;
//          param -= lr*g.
//   AdamW: param *= 1 - lr*wd (decoupled); m += (1-beta1)*(g-m); v = beta2*v + (1-beta2)*g*g;
//          amsgrad: vmax = max(vmax, v), used for v below; bc1 = 1 - beta1^step,
//          bc2 = 1 - beta2^step; denom = sqrt(v)/sqrt(bc2) + eps; param -= (lr/bc1)*m/denom.
// Buffers, n elements each: s1 = SGD momentum buffer (unused when momentum is 0) or AdamW
// exp_avg; s2 = exp_avg_sq; s3 = max_exp_avg_sq (amsgrad only). Unused ones may be null.
void ReferenceOptimizerStep(const OptimizerParams& p, int64_t n,
                            double* param,       // (n) updated in place
                            const double* grad,  // (n) not changed
                            double* s1, double* s2, double* s3);

// Sum of x*x in double, in index order: what SumOfSquares is compared with.
double ReferenceSumOfSquares(const float* x, int64_t n);

}  // namespace lossd

#endif  // LOSSD_KERNELS_CPU_OPTIMIZER_REFERENCE_H_
