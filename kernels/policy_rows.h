// SPDX-License-Identifier: Apache-2.0
// The policy kind's per-row math over a whole problem (kPolicy, core/loss_problem.h), for the
// CPU backend and the CUDA backend's host code: each row's weight in the loss by loss type or
// aggregation, and a row's surrogate, KL term and entropy bonus with their derivatives, in
// double (the row formulas are kernels/policy_math.h's, which the CUDA row kernels share).
// Reads nothing but the problem's per-row inputs; never touches the logits.
#ifndef LOSSD_KERNELS_POLICY_ROWS_H_
#define LOSSD_KERNELS_POLICY_ROWS_H_

#include <cstdint>
#include <vector>

#include "core/loss_problem.h"
#include "kernels/policy_math.h"

namespace lossd {

using PolicyRowTerms = policy_math::RowTerms;

// The row options of `o`, as policy_math reads them.
policy_math::RowOptions PolicyRowOptionsOf(const PolicyParams& o);

// Each row's weight w_i in the loss (its normaliser by loss type, or by the aggregation when
// one is asked), 0 where not counted. counted: (BT) 0 or 1; tokens: their sum.
std::vector<double> PolicyWeights(const LossProblem& p, const std::vector<uint8_t>& counted,
                                  int64_t tokens);

// Row i's terms from its log-prob, its entropy (read only with entropy_coeff != 0) and the
// ratio r (its own at token level; its sequence's with `sequence`).
PolicyRowTerms PolicyTerms(const LossProblem& p, int64_t i, double logp, double entropy, double r,
                           bool sequence);

}  // namespace lossd

#endif  // LOSSD_KERNELS_POLICY_ROWS_H_
