// SPDX-License-Identifier: Apache-2.0
#include "core/distill_topk_check.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "absl/strings/str_cat.h"

namespace lossd {
namespace {

absl::Status CheckShapeAndPointers(const DistillTopkView& t) {
  const int64_t max_k = std::min(t.v, kMaxDistillTopk);
  if (t.k < 1 || t.k > max_k) {
    return absl::InvalidArgumentError(absl::StrCat(
        "teacher_topk_ids: k = ", t.k, " ids per row must be in [1, ", max_k,
        "] (at most V = ", t.v, " and at most ", kMaxDistillTopk, ")"));
  }
  if (t.id_dtype != DType::kI32 && t.id_dtype != DType::kI64) {
    return absl::InvalidArgumentError(absl::StrCat(
        "teacher_topk_ids: dtype must be int32 or int64, got ", DTypeName(t.id_dtype)));
  }
  if (t.bt > 0 && (t.ids == nullptr || t.logp == nullptr)) {
    return absl::InvalidArgumentError(
        "teacher_topk_ids and teacher_topk_logp must both be given");
  }
  const int tail = static_cast<int>(t.params.topk_tail);
  if (tail < 0 || tail >= kDistillTopkTails) {
    return absl::InvalidArgumentError(absl::StrCat(
        "distill.topk_tail ", tail, " is unknown (bucket 0, renormalize 1, none 2)"));
  }
  return absl::OkStatus();
}

// Row i's ids: in [0, V), none repeated (`sorted` is scratch of k).
absl::Status CheckRowIds(const DistillTopkView& t, int64_t i, std::vector<int64_t>* sorted) {
  for (int64_t a = 0; a < t.k; ++a) {
    const int64_t id = LoadAsInt(t.ids, t.id_dtype, static_cast<size_t>(i * t.k + a));
    if (id < 0 || id >= t.v) {
      return absl::InvalidArgumentError(absl::StrCat("teacher_topk_ids[", i, ", ", a, "] = ", id,
                                                     " is outside [0, V=", t.v, ")"));
    }
    (*sorted)[a] = id;
  }
  std::sort(sorted->begin(), sorted->end());
  const auto dup = std::adjacent_find(sorted->begin(), sorted->end());
  if (dup != sorted->end()) {
    return absl::InvalidArgumentError(absl::StrCat("teacher_topk_ids row ", i, " repeats id ",
                                                   *dup, ": each of a row's k ids must differ"));
  }
  return absl::OkStatus();
}

// Row i's log-probs: finite; with the tail bucket a distribution's (sum at most 1 + slack,
// below 1 for the reverse KL, whose empty tail would be infinite).
absl::Status CheckRowLogp(const DistillTopkView& t, int64_t i) {
  double mass = 0;
  for (int64_t a = 0; a < t.k; ++a) {
    const float lp = t.logp[i * t.k + a];
    if (!std::isfinite(lp)) {
      return absl::InvalidArgumentError(
          absl::StrCat("teacher_topk_logp[", i, ", ", a, "] = ", lp, " is not finite"));
    }
    mass += std::exp(static_cast<double>(lp));
  }
  if (t.params.topk_tail != DistillTopkTail::kBucket) return absl::OkStatus();
  if (mass > 1.0 + kDistillTopkMassSlack) {
    return absl::InvalidArgumentError(absl::StrCat(
        "teacher_topk_logp row ", i, ": its probabilities sum to ", mass, " > 1 + ",
        kDistillTopkMassSlack, "; with distill.topk_tail bucket they must be log-probabilities "
        "of one distribution (renormalize and none take any)"));
  }
  if (t.params.jsd_beta == 1.0f && t.k < t.v && !(mass < 1.0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "teacher_topk_logp row ", i, ": its probabilities sum to ", mass,
        ", leaving the tail bucket empty, where the reverse KL (jsd_beta 1) is infinite; use "
        "distill.topk_tail renormalize or none"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckDistillTopk(const DistillTopkView& t) {
  if (absl::Status s = CheckShapeAndPointers(t); !s.ok()) return s;
  std::vector<int64_t> sorted(static_cast<size_t>(t.k));
  for (int64_t i = 0; i < t.bt; ++i) {
    if (t.targets != nullptr && LoadAsInt(t.targets, t.target_dtype, i) == t.ignore_index) {
      continue;
    }
    if (absl::Status s = CheckRowIds(t, i, &sorted); !s.ok()) return s;
    if (absl::Status s = CheckRowLogp(t, i); !s.ok()) return s;
  }
  return absl::OkStatus();
}

}  // namespace lossd
