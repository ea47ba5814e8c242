// SPDX-License-Identifier: Apache-2.0
#include "kernels/cpu/optimizer_step.h"

#include <algorithm>
#include <cstdint>
#include <functional>
#include <vector>

#include "core/dtype.h"
#include "kernels/cpu/cpu_task_pool.h"
#include "kernels/optimizer_math.h"

namespace lossd {
namespace {

// Elements per task: large enough that a task outweighs its scheduling, small enough that a
// 128256 x 4096 head splits into thousands of tasks.
constexpr int64_t kBlock = int64_t{1} << 16;

void ForBlocks(int64_t n, CpuTaskPool* pool, const std::function<void(int64_t, int64_t)>& fn) {
  const int64_t tasks = CeilDiv(n, kBlock);
  const auto run = [&](int64_t task) {
    const int64_t begin = task * kBlock;
    fn(begin, std::min(n, begin + kBlock));
  };
  if (pool == nullptr || tasks <= 1) {
    for (int64_t task = 0; task < tasks; ++task) run(task);
  } else {
    pool->Run(tasks, run);
  }
}

void WriteCopy(const float* param, int64_t begin, int64_t end, void* copy, DType dtype) {
  if (copy == nullptr) return;
  switch (dtype) {
    case DType::kBF16: {
      auto* out = static_cast<uint16_t*>(copy);
      for (int64_t i = begin; i < end; ++i) out[i] = FloatToBf16(param[i]);
      return;
    }
    case DType::kF16: {
      auto* out = static_cast<uint16_t*>(copy);
      for (int64_t i = begin; i < end; ++i) out[i] = FloatToF16(param[i]);
      return;
    }
    case DType::kF32: {
      auto* out = static_cast<float*>(copy);
      for (int64_t i = begin; i < end; ++i) out[i] = param[i];
      return;
    }
    default:
      return;  // refused by CheckOptimizerStep
  }
}

void SgdRange(const OptimizerParams& p, const optimizer_math::Scalars& s,
              const OptimizerTensors& t, int64_t begin, int64_t end) {
  const bool wd = p.weight_decay != 0, momentum = p.momentum != 0;
  for (int64_t i = begin; i < end; ++i) {
    optimizer_math::SgdElement(s, wd, momentum, p.nesterov, p.momentum_initialised,
                               &t.param[i], t.grad[i], momentum ? &t.state1[i] : nullptr);
  }
}

void AdamWRange(const OptimizerParams& p, const optimizer_math::Scalars& s,
                const OptimizerTensors& t, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    optimizer_math::AdamWElement(s, p.amsgrad, &t.param[i], t.grad[i], &t.state1[i],
                                 &t.state2[i], p.amsgrad ? &t.state3[i] : nullptr);
  }
}

}  // namespace

void CpuOptimizerStep(const OptimizerParams& p, const OptimizerTensors& t, CpuTaskPool* pool) {
  const optimizer_math::Scalars s = optimizer_math::ScalarsOf(p);
  ForBlocks(t.n, pool, [&](int64_t begin, int64_t end) {
    if (p.kind == OptimizerKind::kSgd) {
      SgdRange(p, s, t, begin, end);
    } else {
      AdamWRange(p, s, t, begin, end);
    }
    WriteCopy(t.param, begin, end, t.copy, t.copy_dtype);
  });
}

double CpuSumOfSquares(const float* x, int64_t n, CpuTaskPool* pool) {
  std::vector<double> partial(CeilDiv(n, kBlock), 0.0);
  ForBlocks(n, pool, [&](int64_t begin, int64_t end) {
    // Eight running sums: independent chains the compiler may vectorise without reordering
    // any one of them (no -ffast-math), so the result is fixed by n and the data.
    double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t i = begin;
    for (; i + 8 <= end; i += 8) {
      for (int k = 0; k < 8; ++k) acc[k] += static_cast<double>(x[i + k]) * x[i + k];
    }
    for (int k = 0; i < end; ++i, ++k) acc[k] += static_cast<double>(x[i]) * x[i];
    partial[begin / kBlock] =
        ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  });
  double sum = 0;
  for (const double b : partial) sum += b;
  return sum;
}

}  // namespace lossd
