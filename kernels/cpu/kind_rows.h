// SPDX-License-Identifier: Apache-2.0
// The CPU backend's row functions for the loss kinds beyond cross-entropy (logprob, policy,
// distill; core/loss_problem.h): for one row of x W^T in fp32, the stored logits (bias, the
// rounding to the input dtype, softcap, 1/T), their log-sum-exp and what each kind needs of
// them, and G = dL/du (u: the raw logits) written over the row, rounded to the input dtype.
// Pure arithmetic on one row, as row_pass is: no allocation, no other row read, and results
// that do not depend on the instruction set (no FMA contraction).
#ifndef LOSSD_KERNELS_CPU_KIND_ROWS_H_
#define LOSSD_KERNELS_CPU_KIND_ROWS_H_

#include <cstdint>

#include "core/dtype.h"
#include "core/loss_problem.h"

namespace lossd {

// Per-head constants: the student's, or (distill) the teacher's with its own bias.
struct KindRowParams {
  int64_t v = 0;
  DType dtype = DType::kBF16;
  const float* bias = nullptr;  // (V) fp32, null = none
  float cap = 0;                // softcap, 0 = off (applied before 1/T, as the references do)
  float temperature = 1;        // T
};

// One row's logits statistics, from HeadRowForward.
struct HeadRowStats {
  double lse = 0;      // log sum_j exp z_j, z = softcap(u) / T
  float max = 0;       // max_j z_j
  float log_sum = 0;   // log sum_j exp(z_j - max), so log p_j = (z_j - max) - log_sum
  int64_t argmax = 0;  // first index reaching the max
  double logp = 0;     // z_t - lse (t >= 0)
  double entropy = 0;  // -sum_j p_j log p_j (when asked)
};

// Turns z (V) from x W^T in fp32 into the row's logits z = softcap(round(u + b)) / T in place
// and returns their statistics; logp for t >= 0, the entropy when want_entropy.
HeadRowStats HeadRowForward(const KindRowParams& kp, float* z, int64_t t, bool want_entropy);

// Overwrites the logits z (HeadRowForward's) with the gradient of a logp_t + e H over the raw
// logits u, rounded to the input dtype:
//   g_j = (a ([j = t] - p_j) - e p_j (log p_j + H)) / T * (1 - tanh^2)   (tanh: the softcap's)
// `a` and `e` carry every scale but 1/T (the upstream gradient, the GEMMs' alpha taken out);
// with e != 0, s must hold the entropy (HeadRowForward's want_entropy). t >= 0.
void WriteLogprobGradient(const KindRowParams& kp, float* z, int64_t t, const HeadRowStats& s,
                          double a, double e);

// What DistillRow reports.
struct DistillRowResult {
  double divergence = 0;  // the row's generalised JSD
  double hard = 0;        // the label's cross-entropy at temperature 1 (with a hard term)
  double lse = 0;         // the student's
  int64_t argmax = 0;     // the student's
};

// A distillation row's terms: the divergence's weight, and the hard-label term's with its
// label (distill_reference.h: LigerFusedLinearJSDLoss's weight_soft_loss / weight_hard_loss).
struct DistillRowTerms {
  double jsd_beta = 0.5;
  double w_soft = 1;
  double w_hard = 0;  // 0: no hard term
  int64_t label = -1;  // in [0, V) where w_hard != 0
};

// One distillation row: zs (V) the student's x W^T, zt (V) the teacher's, both in fp32 and
// turned into their logits in place (no softcap); the row's divergence at jsd_beta (the
// reference's three cases) and with w_hard the label's cross-entropy of the unscaled logits
// (z T); when want_grad, zs overwritten with k d(w_soft row + w_hard ce) / d u (u: the
// student's raw logits, so 1/T is applied here; k carries 1 / tokens, the upstream gradient
// and the GEMMs' alpha), rounded to the input dtype.
DistillRowResult DistillRow(const KindRowParams& student, const KindRowParams& teacher, float* zs,
                            float* zt, const DistillRowTerms& terms, double k, bool want_grad);

// One row of a top-k teacher: its k ids and their log-probs (the teacher's, as sent).
struct TopkTeacherRow {
  const void* ids = nullptr;     // (k) id_dtype: int32 or int64, each in [0, V), distinct
  DType id_dtype = DType::kI64;
  const float* logp = nullptr;   // (k), finite
  int64_t k = 0;                 // in [1, min(V, kMaxDistillTopk)]
  DistillTopkTail tail = DistillTopkTail::kBucket;
};

// A top-k teacher's row in two steps, so that the GEMMs' alpha can come from the chunk's rows
// (a top-k row's G can lie far below its a-priori bound, where an fp16 G would lose its
// digits): DistillTopkForward turns zs (V, the student's x W^T in fp32) into its logits and
// returns the row's state (distill_reference.h's events by the tail's treatment, in double,
// the student's mass outside the ids summed directly, the hard term); WriteTopkGradient then
// overwrites the logits with k d(w_soft row + w_hard ce) / d u, rounded to the input dtype.
// No allocation: a row's k ids, logits and derivatives sit on the stack.
struct TopkRowState {
  HeadRowStats stats;     // the student's (lse, max, log_sum, argmax)
  double divergence = 0;  // the row's
  double hard = 0;        // the label's cross-entropy at T 1 (with a hard term)
  double lse_q = 0, lse_p = 0;  // what the ids' log q and log p are taken against
  double d_sum = 0;       // sum over the events of d row / d log q
  double e_tail = 0;      // the tail's d row / d log q_tail over q_tail (bucket)
  double lse1 = 0;        // the unscaled logits' log-sum-exp (with a hard term)
  double g_bound = 0;     // max_j |G_j| / k is at most this
};
TopkRowState DistillTopkForward(const KindRowParams& student, float* zs, const TopkTeacherRow& t,
                                const DistillRowTerms& terms);
void WriteTopkGradient(const KindRowParams& student, float* zs, const TopkTeacherRow& t,
                       const DistillRowTerms& terms, const TopkRowState& st, double k);

}  // namespace lossd

#endif  // LOSSD_KERNELS_CPU_KIND_ROWS_H_
