// SPDX-License-Identifier: Apache-2.0
// The float64 reference of the `logprob` loss kind: per token, at temperature T, the log-
// probability of the target and the entropy of the softmax, and, given upstream gradients of
// both, dX, dW and db. Reads the inputs as stored; one row of V logits at a time, in double.
//
// Per row i with target t_i != ignore_index (u = x_i W^T + b, the raw logits):
//   z_ij   = softcap(u_ij) / T       softcap(u) = cap tanh(u / cap) as the cross-entropy
//                                     reference applies it (before T); cap 0 = off
//   lse_i  = log sum_j exp z_ij,      p_ij = exp(z_ij - lse_i)
//   logp_i = z_it - lse_i
//   H_i    = -sum_j p_ij log p_ij = lse_i - sum_j p_ij z_ij
// The gradients are those of F = sum_i (dlogp_i logp_i + dentropy_i H_i):
//   dF/dz_ij = dlogp_i ([j = t_i] - p_ij) - dentropy_i p_ij (log p_ij + H_i)
// then through 1/T and the softcap's (1 - tanh^2) to u, and dX = G W, dW = G^T X, db = colsum G.
// Ignored rows (target == ignore_index) give logp 0, entropy 0 and no gradient; their lse is
// still computed. At T = 1 without softcap, -logp_i is the cross-entropy reference's per-token
// loss with reduction none.
#ifndef LOSSD_KERNELS_CPU_LOGPROB_REFERENCE_H_
#define LOSSD_KERNELS_CPU_LOGPROB_REFERENCE_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "core/dtype.h"
#include "core/loss_problem.h"
#include "kernels/cpu/reference_head.h"

namespace lossd {

struct LogprobOptions {
  float temperature = 1.0f;  // T: finite, > 0
  float softcap = kDefaultSoftcap;  // finite, >= 0; 0 = off
  int64_t ignore_index = kDefaultIgnoreIndex;
};

struct LogprobProblem {
  HeadInputs head;
  const void* targets = nullptr;     // (BT) target_dtype, in [0, V) or ignore_index
  DType target_dtype = DType::kI64;  // kI32 or kI64
  const float* dlogp = nullptr;      // (BT) upstream gradient of logp; null = zeros
  const float* dentropy = nullptr;   // (BT) upstream gradient of the entropy; null = zeros
  LogprobOptions options;
};

struct LogprobReferenceOutputs {
  std::vector<double> logp;     // (BT); 0 on ignored rows
  std::vector<double> entropy;  // (BT); 0 on ignored rows
  std::vector<double> lse;      // (BT) of z (after softcap and 1/T), every row
  int64_t tokens = 0;           // non-ignored rows
  HeadGradients grad;           // of F above; zero without dlogp and dentropy
};

// Computes every output of `p`; INVALID_ARGUMENT (naming the field and value) for a problem
// outside the rules above.
absl::Status LogprobReference(const LogprobProblem& p, LogprobReferenceOutputs* out);

// Row i's target log-probability and entropy.
double RowLogprob(const HeadRow& row, int64_t t);
double RowEntropy(const HeadRow& row, const std::vector<double>& p);  // p: (V) softmax

// dF/dz of one row (the formula above) into g (V), from its softmax p (V).
void LogprobLogitGradient(const HeadRow& row, const std::vector<double>& p, int64_t t,
                          double dlogp, double dentropy,
                          std::vector<double>* g);  // (V)

// INVALID_ARGUMENT unless every target is in [0, v) or equals ignore_index; `name` names the
// array in the message.
absl::Status CheckTargets(const void* targets, DType target_dtype, int64_t bt, int64_t v,
                          int64_t ignore_index, const char* name);

}  // namespace lossd

#endif  // LOSSD_KERNELS_CPU_LOGPROB_REFERENCE_H_
