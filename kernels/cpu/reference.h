// SPDX-License-Identifier: Apache-2.0
// The float64 reference of linear + cross-entropy: the oracle every backend is tested against.
// Reads the inputs as stored (bf16/fp16 widened exactly), computes in double, one row of V
// logits at a time; it never materialises BT x V, never rounds logits, and is never fast.
#ifndef LOSSD_KERNELS_CPU_REFERENCE_H_
#define LOSSD_KERNELS_CPU_REFERENCE_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "core/loss_problem.h"

namespace lossd {

// Every output of one problem, in float64. Always computed in full (all outputs, all
// gradients), whatever a LossOutputs would ask for.
struct ReferenceOutputs {
  std::vector<double> loss;          // (BT) with reduction none, else (1)
  std::vector<double> z_loss;        // (BT) with reduction none, else (1)
  std::vector<double> lse;           // (BT) every row, ignored rows included
  std::vector<int64_t> predictions;  // (BT) argmax of the final logits, first index on ties
  double accuracy = 0;               // over non-ignored rows; 0 when there are none
  int64_t tokens = 0;                // non-ignored rows
  std::vector<double> dx;            // (BT, H) row-major
  std::vector<double> dw;            // (V, H) row-major
  std::vector<double> db;            // (V) empty when the problem has no bias
};

// Computes every output of `p` (the semantics of core/loss_problem.h). `p` must have passed
// ValidateLossInputs (core/loss_problem_check.h): the reference assumes it, and only debug
// builds check it (aborting on a problem that was never validated). Host memory only: a
// p.w_memory other than kHost is INVALID_ARGUMENT.
//
// Mean reduction divides the cross-entropy part by the class-weight sum of the non-ignored
// targets (their count without weights) and the z-loss part by the non-ignored count; a zero
// denominator (every target ignored) gives loss 0 and zero gradients, never NaN. Token
// scaling multiplies a row's loss, z-loss and gradient by its exact p_t (not rounded).
absl::Status ReferenceCompute(const LossProblem& p, ReferenceOutputs* out);

}  // namespace lossd

#endif  // LOSSD_KERNELS_CPU_REFERENCE_H_
