// SPDX-License-Identifier: Apache-2.0
// The float64 reference of the `distill` loss kind: a generalised Jensen-Shannon divergence
// between a student head's and a teacher head's distributions, and the student's dX, dW, db
// (the teacher gets no gradient). Reads the inputs as stored; one row at a time, in double.
//
// Semantics: those of Liger-Kernel 0.8.5's LigerFusedLinearJSD (jsd_beta, ignore_index,
// temperature; the sum over rows divided by the non-ignored count). Per row i, with
//   Q = softmax((x_i W^T + b) / T)        the student (log q = its log-softmax)
//   P = softmax((xt_i Wt^T + bt) / T)     the teacher (its own hidden size; Liger: no biases)
//   jsd_beta = 0:    row_i = KL(P || Q) = sum_j P_j (log P_j - log Q_j)    (forward KL)
//   jsd_beta = 1:    row_i = KL(Q || P) = sum_j Q_j (log Q_j - log P_j)    (reverse KL)
//   else, M = beta P + (1 - beta) Q:
//                    row_i = beta KL(P || M) + (1 - beta) KL(Q || M)
// (the ends are Liger's special cases, compared exactly: the general form tends to 0 there,
// not to the KLs.) loss = sum_i row_i / n, n = the rows whose label is not
// ignore_index (every row without labels); an all-ignored problem gives loss 0. Labels are
// only compared with ignore_index (any other value is fine). No T^2 factor, as in Liger.
// With the hard-label term (Liger-Kernel's LigerFusedLinearJSDLoss: weight_hard_loss w_h and
// weight_soft_loss w_s), the loss is
//   loss = (w_h sum_i ce_i + w_s sum_i row_i) / n,   ce_i = lse(u_i) - u_it   (u = x W^T + b)
// the cross-entropy of the label at temperature 1 (Liger takes it from the logits before they
// are divided by T); every counted row's label must then lie in [0, V). w_h 0, w_s 1 (the
// defaults) is the divergence alone, LigerFusedLinearJSD's loss.
// From the teacher's top-k instead of its head (ids S = s_1..s_k of row i and their log-probs
// lp_a, taken as sent: T divides the student's logits only), the same three divergences over
// events e with teacher and student log-probs (log p_e, log q_e), by topk_tail:
//   bucket (default): e = each id (lp_a, log Q_{s_a}) and the tail (log(1 - sum_a exp lp_a),
//                     log sum_{j not in S} Q_j), the tail's p clamped at 0; no tail when k = V
//   renormalize:      e = each id, (lp_a - lse(lp), z_{s_a} - lse_{j in S}(z_j))
//   none:             e = each id (lp_a, log Q_{s_a}), unnormalised (verl's forward_kl_topk)
// row_i = sum_e f(p_e, q_e) with the per-event forms of the three cases (an event of p = 0
// adds nothing to the forward KL or the JSD's teacher side); d_e = d row / d log q_e as below,
// then d log q_e / dz_j: [j = s_a] - Q_j for an id (renormalize: [j = s_a] - Q'_j [j in S]),
// [j not in S] Q_j / q_tail - Q_j for the tail.
// Gradient of grad_scale * loss, with d_j = d row_i / d log Q_j:
//   beta 0: d_j = -P_j;   beta 1: d_j = Q_j (log Q_j - log P_j + 1);
//   else:   d_j = (1 - beta) Q_j (log Q_j - log M_j)
//   d row_i / d z_j = d_j - Q_j sum_k d_k, then 1/T and the student head;
//   d ce_i / d u_j = softmax(u_i)_j - [j = t_i].
#ifndef LOSSD_KERNELS_CPU_DISTILL_REFERENCE_H_
#define LOSSD_KERNELS_CPU_DISTILL_REFERENCE_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "core/dtype.h"
#include "core/loss_problem.h"
#include "kernels/cpu/reference_head.h"

namespace lossd {

// Defaults are Liger-Kernel's (LigerFusedLinearJSD's constructor).
struct DistillOptions {
  float jsd_beta = 0.5f;     // in [0, 1]
  float temperature = 1.0f;  // T: finite, > 0
  int64_t ignore_index = kDefaultIgnoreIndex;
  float grad_scale = kDefaultGradScale;  // upstream gradient of the loss: finite
  // The hard-label cross-entropy's and the divergence's weights: finite, >= 0. Liger's
  // LigerFusedLinearJSDLoss defaults to 0.5 each; these defaults are the divergence alone.
  float weight_hard_loss = 0.0f;
  float weight_soft_loss = 1.0f;
  DistillTopkTail topk_tail = DistillTopkTail::kBucket;  // with a top-k teacher
};

struct DistillProblem {
  HeadInputs student;  // X (BT, H), W (V, H), bias (V) or null
  HeadInputs teacher;  // Xt (BT, Ht), Wt (V, Ht), bias (V) or null: the same BT and V
  // The teacher as its top-k instead of a head (then `teacher` is unused): k > 0 ids per row
  // and their log-probs; 0 = the head.
  int64_t topk = 0;
  const void* topk_ids = nullptr;     // (BT, k) topk_id_dtype: int32 or int64
  DType topk_id_dtype = DType::kI64;
  const float* topk_logp = nullptr;   // (BT, k)
  const void* labels = nullptr;     // (BT) label_dtype; null = every row counts
  DType label_dtype = DType::kI64;  // kI32 or kI64
  DistillOptions options;
};

struct DistillReferenceOutputs {
  double loss = 0;
  int64_t tokens = 0;             // n
  std::vector<double> row_loss;   // (BT) row_i before the division; 0 on ignored rows
  double soft_loss = 0;           // sum_i row_i / n
  double hard_loss = 0;           // sum_i ce_i / n (0 when w_h is 0)
  HeadGradients grad;             // the student's, of grad_scale * loss
};

// Computes every output of `p`; INVALID_ARGUMENT (naming the field and value) for a problem
// outside the rules above.
absl::Status DistillReference(const DistillProblem& p, DistillReferenceOutputs* out);

}  // namespace lossd

#endif  // LOSSD_KERNELS_CPU_DISTILL_REFERENCE_H_
