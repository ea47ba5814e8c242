// SPDX-License-Identifier: Apache-2.0
// The CPU backend's policy math for one row (kPolicy, core/loss_problem.h): each row's weight
// in the loss by loss type or aggregation, and a row's surrogate, KL term and entropy bonus
// with their derivatives, in double. The formulas are the float64 reference's
// (policy_reference.h), written again here so that the reference stays the independent oracle.
// Reads nothing but the problem's per-row inputs; never touches the logits.
#ifndef LOSSD_KERNELS_CPU_POLICY_ROWS_H_
#define LOSSD_KERNELS_CPU_POLICY_ROWS_H_

#include <cstdint>
#include <vector>

#include "core/loss_problem.h"

namespace lossd {

// Each row's weight w_i in the loss (its normaliser by loss type, or by the aggregation when
// one is asked), 0 where not counted. counted: (BT) 0 or 1; tokens: their sum.
std::vector<double> PolicyWeights(const LossProblem& p, const std::vector<uint8_t>& counted,
                                  int64_t tokens);

// One row's terms, before its weight.
struct PolicyRowTerms {
  double loss = 0;  // l_i = pg_i (times rho_i) + beta kl_i - entropy_coeff H_i
  double kl = 0;    // kl_i (times r with the bias correction)
  bool clipped = false;
  // dl_i/dlogp_i: at token level all of it; at sequence level the part that does not pass
  // through the ratio, `via_ratio` being dl_i/dr times r, which reaches every token of the
  // sequence through the mean of its log-ratios.
  double dlogp = 0;
  double via_ratio = 0;
  double dentropy = 0;  // dl_i/dH_i: -entropy_coeff
};

// Row i's terms from its log-prob, its entropy (read only with entropy_coeff != 0) and the
// ratio r (its own at token level; its sequence's with `sequence`).
PolicyRowTerms PolicyTerms(const LossProblem& p, int64_t i, double logp, double entropy, double r,
                           bool sequence);

}  // namespace lossd

#endif  // LOSSD_KERNELS_CPU_POLICY_ROWS_H_
