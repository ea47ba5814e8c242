// SPDX-License-Identifier: Apache-2.0
// What the optimizer step tests share (the CPU backend's against the float64 oracle, the CUDA
// backend's against the CPU backend's): every option combination of SGD and AdamW, random
// buffers, the parameters of each step of a run, and an fp32-vs-double comparison with its
// tolerance table. Test-only; never linked into the server.
#ifndef LOSSD_TESTING_OPTIMIZER_CASES_H_
#define LOSSD_TESTING_OPTIMIZER_CASES_H_

#include <cstdint>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "kernels/optimizer.h"

namespace lossd {

struct OptimizerCase {
  std::string name;
  OptimizerParams params;  // of the run's first step (ParamsAtStep gives the later ones)
  bool copy = true;        // whether the step writes a compute copy
  DType copy_dtype = DType::kBF16;
};

// SGD: weight decay {0, 0.01} x (momentum, dampening, nesterov) in {none, 0.9, 0.9 with
// dampening 0.3, 0.9 nesterov}; AdamW: weight decay {0, 0.1} x amsgrad x beta1 {0.9, 0.3}
// (0.3 takes torch's other lerp branch). Each x grad_scale {1, 0.7}; the copy's dtype cycles
// through bf16, fp16, fp32 and none.
std::vector<OptimizerCase> AllOptimizerCases();

// The parameters of step k (k = 0 first) of a run that starts with `first`: AdamW's step
// counts up from first.step; SGD's momentum buffer is initialised from the second step on.
OptimizerParams ParamsAtStep(const OptimizerParams& first, int k);

// One parameter's host buffers, n fp32 elements each, random and never zero: param uniform in
// [-1, 1); state1 in [-0.1, 0.1) (NaN for SGD before its first momentum step, to show it is
// not read); state2 in [0, 0.01); state3 = state2 plus [0, 0.01) for some elements, else
// state2 minus a little (so both sides of amsgrad's max occur). copy is poisoned (0xFF).
struct OptimizerBuffers {
  int64_t n = 0;
  std::vector<float> param, state1, state2, state3;
  std::vector<uint8_t> copy;  // n * 4 bytes, the widest dtype
};
OptimizerBuffers RandomOptimizerBuffers(const OptimizerCase& c, int64_t n, uint64_t seed);

// A gradient of n elements, each uniform in [-1, 1) times 10^u, u uniform in [-3, 1).
std::vector<float> RandomGradient(int64_t n, uint64_t seed);

// The tensors over b's host buffers (what the CPU backend takes directly).
OptimizerTensors HostTensors(const OptimizerCase& c, OptimizerBuffers& b, const float* grad);

// The fp32 step's error against the double oracle, in units of 2^-24 (an fp32 ulp at 1):
//   normwise:    max_i |a_i - r_i| / max_i |r_i|  (param, exp_avg, SGD's buffer: their
//                updates subtract, so an element near zero carries its operands' rounding);
//   elementwise: max_i |a_i - r_i| / |r_i|       (exp_avg_sq and its max: sums of
//                non-negative terms, no cancellation).
double NormwiseUlps(const std::vector<float>& a, const std::vector<double>& r);
double ElementwiseUlps(const std::vector<float>& a, const std::vector<double>& r);

// Elements of v that are NaN: a bit-for-bit comparison of two steps means little when the
// data went NaN (for SGD, a momentum step over the NaN a fresh buffer holds).
int64_t CountNan(const std::vector<float>& v);

// The tolerance table for fp32 against the oracle after kOptimizerSteps steps, in the units
// above: each step rounds about ten times, and the state carries earlier steps' rounding.
constexpr int kOptimizerSteps = 5;
constexpr double kParamUlps = 32;
constexpr double kState1Ulps = 32;
constexpr double kState2Ulps = 16;

}  // namespace lossd

#endif  // LOSSD_TESTING_OPTIMIZER_CASES_H_
