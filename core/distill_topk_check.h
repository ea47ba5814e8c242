// SPDX-License-Identifier: Apache-2.0
// The rules on kDistill's top-k teacher (LossProblem::teacher_topk; loss_problem.h): its
// shape and the values of every counted row's ids and log-probs. Shared by the one validation
// (loss_problem_check.h) and the float64 reference, so both refuse alike. Reads the rows it
// checks; never allocates beyond one row's ids.
#ifndef LOSSD_CORE_DISTILL_TOPK_CHECK_H_
#define LOSSD_CORE_DISTILL_TOPK_CHECK_H_

#include <cstdint>

#include "absl/status/status.h"
#include "core/dtype.h"
#include "core/loss_problem.h"

namespace lossd {

// Views of a top-k teacher and what decides which rows count, all in host memory.
struct DistillTopkView {
  int64_t bt = 0, v = 0, k = 0;
  const void* ids = nullptr;       // (BT, k) id_dtype
  DType id_dtype = DType::kI64;
  const float* logp = nullptr;     // (BT, k)
  const void* targets = nullptr;   // (BT) target_dtype; null = every row counts
  DType target_dtype = DType::kI64;
  int64_t ignore_index = kDefaultIgnoreIndex;
  DistillParams params;
};

// INVALID_ARGUMENT naming the field, row and value unless: k in [1, min(V, kMaxDistillTopk)],
// ids int32 or int64 and non-null with the log-probs; in every counted row (a row whose
// target is ignore_index is never read), each id in [0, V) and none repeated, each log-prob
// finite; with topk_tail kBucket the row's probabilities sum to at most 1 +
// kDistillTopkMassSlack, and (jsd_beta 1, the reverse KL, where k < V) below 1: the reverse
// KL of an empty tail is infinite.
absl::Status CheckDistillTopk(const DistillTopkView& t);

}  // namespace lossd

#endif  // LOSSD_CORE_DISTILL_TOPK_CHECK_H_
