// SPDX-License-Identifier: Apache-2.0
// The per-row kernel of the logprob and policy loss kinds (core/loss_problem.h; the float64
// references kernels/cpu/logprob_reference.h and policy_reference.h are the math): over one
// chunk of stored logits u (input dtype), per row at temperature T,
//   z_ij  = softcap(u_ij + b_j) / T,  lse_i = log sum_j exp z_ij,  p_ij = exp(z_ij - lse_i)
//   logp_i = z_it - lse_i,            H_i = lse_i - sum_j p_ij z_ij
// and the gradient written in place over the logits, in the input dtype:
//   g_ij = [ c_i ([j = t] - p_ij) - e_i p_ij (z_ij - lse_i + H_i) ] (1/T) softcap'(u_ij + b_j)
// with logprob's c_i = dlogp_i, e_i = dentropy_i (each already times grad_scale / alpha), and
// policy's c_i = w_i dl_i/dlogp_i computed here from logp_i by kernels/policy_math.h: the loss
// type's surrogate (times is_ratio's rho_i where given) and the KL estimator's term, in
// double, times the row's weight w_i (its loss normaliser or aggregation weight, times
// grad_scale / alpha) which the host computes from the mask; policy's e_i, the entropy
// bonus's -entropy_coeff w_i, comes from the host as logprob's does. (Policy at sequence level runs
// as logprob: its c_i needs the whole sequence's logp, so the host computes it between a
// forward pass and this kernel's gradient pass; policy_sequence.h.)
// alpha, a power of two, is the caller's: it comes back in the dX/dW/db GEMMs' alpha, so
// small coefficients do not underflow a 16-bit G. A row is read once by a cluster of blocks
// (the one-read kernels) or by one block (the two-pass kernels, where the one-read kernels do
// not apply: row_loss_launch.h), each in a fixed reduction tree: deterministic. Never
// allocates and never synchronises.
//
// Distill (distill_reference.h): the teacher's logits u_t come in a second chunk buffer; with
// Q = softmax(z), P = softmax(z_t) per row, the generalised JSD row_i (written into row_logp)
// and, with d_j = d row_i / d log Q_j, g_ij = c (d_j - Q_ij sum_k d_k) / T, c = w_s grad_scale /
// (n alpha) on rows that count (n of them), 0 on ignored ones; with the hard-label term
// (LigerFusedLinearJSDLoss' weight_hard_loss w_h) g_ij gains h (softmax(u_i)_j - [j = t_i]),
// h = w_h grad_scale / (n alpha), u the logits at temperature 1. The one-read kernel reads each
// row once; the two-pass kernel reads the student row three times (statistics, the divergence
// and sum d, the gradient) and the teacher's twice.
#ifndef LOSSD_KERNELS_CUDA_ROW_LOSS_KERNELS_H_
#define LOSSD_KERNELS_CUDA_ROW_LOSS_KERNELS_H_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/policy_math.h"

namespace lossd {
namespace cuda {

inline constexpr int32_t kRowLossLogprob = 1;  // lossd::LossKind::kLogprob
inline constexpr int32_t kRowLossPolicy = 2;   // lossd::LossKind::kPolicy
inline constexpr int32_t kRowLossDistill = 3;  // lossd::LossKind::kDistill (no softcap)

struct RowLossParams {
  void* logits;            // (rows, v) row-major, elem; overwritten by g when write_grad
  int32_t elem;            // ElemType (ce_kernels.h) of logits and bias
  int64_t rows;
  int64_t v;
  const void* bias;        // (v) elem, or null (absent, or already in the stored logits)
  const int32_t* targets;  // (rows) in [0, v), or -1 for an ignored (masked) row
  float softcap;           // > 0: softcap(u) = cap tanh(u / cap)
  float inv_temperature;   // 1 / T
  int32_t kind;            // kRowLossLogprob or kRowLossPolicy
  int32_t write_grad;      // 0: statistics only, logits left as they are
  // Logprob: c_i and e_i (each null = zeros); policy: e_i, its entropy bonus's (null = none).
  const float* coef_logp;
  const float* coef_entropy;
  // Policy: w_i (0 on masked rows), A_i, and the optional old and reference log-probs.
  const float* row_weight;
  const float* advantages;
  const float* old_logp;  // null: the current log-probs detached (ratio 1)
  const float* ref_logp;  // null: no KL term
  const float* is_ratio;  // rho_i on the surrogate's term, not the KL's (vllm_is_ratio); null: 1
  policy_math::RowOptions policy;  // the loss type, clip bounds, KL estimator and the rest
  // Distill: the teacher's logits (rows, v) elem, its bias (or null) and the options.
  const void* teacher_logits;
  const void* teacher_bias;
  float jsd_beta;
  float distill_coef;  // c above, times weight_soft_loss
  // The hard-label term's w_h grad_scale / (n alpha) (0: none): targets then hold the labels,
  // row_entropy gets each row's ce_i = lse(u) - u_t at temperature 1, and G gains
  // hard_coef (softmax(u)_j - [j = t]). Only the two-pass kernel computes it.
  float hard_coef;
  // Per row, always written (0 logp and entropy on ignored rows; lse on every row).
  float* row_lse;
  float* row_logp;     // distill: the row's divergence
  float* row_entropy;  // distill: unused
  int32_t* row_pred;  // argmax_j z_ij, first index on ties; may be null
};

cudaError_t LaunchRowLoss(const RowLossParams& p, cudaStream_t stream);

}  // namespace cuda
}  // namespace lossd

#endif  // LOSSD_KERNELS_CUDA_ROW_LOSS_KERNELS_H_
