// SPDX-License-Identifier: Apache-2.0
// The checks every backend runs before an optimizer step (kernels/optimizer.h): the scalars
// torch would accept and the buffers the chosen update reads and writes. Never looks at the
// data, and never decides what a head's defaults are (the engine does).
#ifndef LOSSD_KERNELS_OPTIMIZER_CHECK_H_
#define LOSSD_KERNELS_OPTIMIZER_CHECK_H_

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/optimizer.h"

namespace lossd {

// INVALID_ARGUMENT naming the field and its value when a step cannot run as torch would run
// it: torch.optim's own constructor checks (lr, momentum, weight_decay, betas, eps >= 0; a
// nesterov step needs momentum > 0 and dampening 0), every scalar finite, step >= 1, n >= 0,
// a null buffer the update needs, or a copy dtype that is not bf16, fp16 or fp32.
absl::Status CheckOptimizerStep(const OptimizerParams& p, const OptimizerTensors& t);

// INVALID_ARGUMENT unless n >= 0 and data is non-null when n > 0.
absl::Status CheckSumOfSquares(const float* data, int64_t n);

}  // namespace lossd

#endif  // LOSSD_KERNELS_OPTIMIZER_CHECK_H_
