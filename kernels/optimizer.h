// SPDX-License-Identifier: Apache-2.0
// The optimizer step of a hosted head (engine/heads.h), as one elementwise pass a backend runs
// over resident fp32 buffers: torch.optim.SGD and torch.optim.AdamW (foreach=False,
// fused=False) applied to a summed gradient, then the compute copy refreshed as the cast of
// the updated master. Plain data only; a backend never sees gRPC, protobuf or a head.
#ifndef LOSSD_KERNELS_OPTIMIZER_H_
#define LOSSD_KERNELS_OPTIMIZER_H_

#include <cstdint>

#include "core/dtype.h"

namespace lossd {

enum class OptimizerKind : int32_t { kSgd = 0, kAdamW = 1 };

// One parameter's update. Scalars are double, as torch computes them in Python; a backend
// rounds each to fp32 where torch's tensor op would (see kernels/optimizer_math.h for the fp32
// operation order, which follows torch's single-tensor code and which the CPU and the CUDA
// backend share, so the two agree bit for bit; kernels/optimizer_check.h for what a backend
// refuses; kernels/cpu/optimizer_reference.h for the float64 oracle).
struct OptimizerParams {
  OptimizerKind kind = OptimizerKind::kAdamW;
  double lr = 1e-3;
  double weight_decay = 0;  // SGD: added to the gradient; AdamW: decoupled, p *= 1 - lr*wd
  // SGD.
  double momentum = 0;
  double dampening = 0;
  bool nesterov = false;
  // SGD with momentum: whether the momentum buffer holds a value (torch's buffer is None
  // before the first step: it then starts as a copy of the gradient).
  bool momentum_initialised = false;
  // AdamW.
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  bool amsgrad = false;
  // AdamW: torch's `step` after this update's increment (1 on the first update).
  int64_t step = 1;
  // The gradient is first multiplied by this fp32 value (a clip coefficient, as
  // torch.nn.utils.clip_grad_norm_ scales grads in place); 1 = unchanged.
  float grad_scale = 1.0f;
};

// The buffers of one parameter, n fp32 elements each, in backend memory (Allocate's).
struct OptimizerTensors {
  int64_t n = 0;
  float* param = nullptr;       // the fp32 master, updated in place
  const float* grad = nullptr;  // the summed gradient (not changed)
  float* state1 = nullptr;      // AdamW exp_avg; SGD momentum_buffer (null when momentum 0)
  float* state2 = nullptr;      // AdamW exp_avg_sq
  float* state3 = nullptr;      // AdamW max_exp_avg_sq (amsgrad only)
  // n elements of copy_dtype: receives the cast (round to nearest even) of the updated
  // master; null = none. bf16, fp16 or fp32.
  void* copy = nullptr;
  DType copy_dtype = DType::kBF16;
};

}  // namespace lossd

#endif  // LOSSD_KERNELS_OPTIMIZER_H_
