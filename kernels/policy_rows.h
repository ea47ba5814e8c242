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

// One row of a group of a policy Compute by sequence (PolicyBySequence: GSPO's sequence
// ratio, geo_mean's geometric mean; kl_cov's whole call).
struct PolicySequenceRow {
  PolicyRowTerms terms;  // its terms at its sequence's ratio (clipped: the row's own)
  double ratio = 1;      // its sequence's R_b
  double loss = 0;       // its weighted share of the loss
  double coef = 0;       // dloss/dlogp_i before grad_scale
};

// The rows [b0, b0 + S) of one sequence (S = BT / sequences): each counted row's ratio, terms,
// loss share and coefficient from every logp of the sequence (the formulas of
// kernels/cpu/policy_reference.h): GSPO's R_b = exp(mean of logp - old), each row's
// coefficient w_i f_i + (1 / max(1, n_b)) sum_{j in b} w_j e_j; geo_mean's R_b from the
// clipped log-ratios, its policy term (1/B) pg_b spread as (1/B) pg_b g_i / n_b, its KL and
// entropy terms by w_i; kl_cov's group is the whole call (b0 0, PolicyGroupRows): each row
// at its own ratio, the penalty on the rows of largest covariance; vespo's rows each at their
// own ratio, their policy term -phi A logp with phi their sequence's constant gamma weight.
// counted, weight (PolicyWeights), logp and entropy (read only with entropy_coeff != 0) are
// per row of the whole problem; rows gets PolicyGroupRows entries (an uncounted row's left at
// its defaults).
void PolicySequenceRows(const LossProblem& p, const uint8_t* counted, const double* weight,
                        const double* logp, const double* entropy, int64_t b0,
                        PolicySequenceRow* rows);

}  // namespace lossd

#endif  // LOSSD_KERNELS_POLICY_ROWS_H_
