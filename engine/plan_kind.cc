// SPDX-License-Identifier: Apache-2.0
#include "engine/plan_kind.h"

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/loss_problem_check.h"
#include "core/status_macros.h"
#include "engine/owner.h"
#include "engine/request_checks.h"

namespace lossd {
namespace {

const TensorDesc& Input(const ComputeSpec& spec, InputSlot s) {
  return spec.inputs[static_cast<int>(s)];
}

uint64_t& Bytes(ComputePlan* plan, InputSlot s) {
  return plan->input_bytes[static_cast<int>(s)];
}

absl::Status OtherKinds(const char* field, LossKind owner, LossKind kind) {
  return absl::InvalidArgumentError(absl::StrCat("header.", field, " is for kind ",
                                                 LossKindName(owner), "; this request's kind is ",
                                                 LossKindName(kind)));
}

// The per-row fp32 inputs (dlogp, dentropy, advantages, old_logp, ref_logp, is_ratio): only the kind
// they belong to, (BT) fp32; policy's advantages are required.
absl::Status PlanRowInputs(const ComputeSpec& spec, ComputePlan* plan) {
  struct Row {
    InputSlot slot;
    LossKind owner;
  };
  const Row rows[] = {{InputSlot::kDlogp, LossKind::kLogprob},
                      {InputSlot::kDentropy, LossKind::kLogprob},
                      {InputSlot::kAdvantages, LossKind::kPolicy},
                      {InputSlot::kOldLogp, LossKind::kPolicy},
                      {InputSlot::kRefLogp, LossKind::kPolicy},
                      {InputSlot::kIsRatio, LossKind::kPolicy}};
  for (const Row& r : rows) {
    const TensorDesc& t = Input(spec, r.slot);
    const char* name = InputSlotName(r.slot);
    if (!t.present) continue;
    if (spec.kind != r.owner) return OtherKinds(name, r.owner, spec.kind);
    LOSSD_RETURN_IF_ERROR(CheckShape(t, name, 1));
    if (t.shape[0] != plan->bt) {
      return absl::InvalidArgumentError(absl::StrCat(name, ".shape ", ShapeString(t.shape),
                                                     " must be (BT) = [", plan->bt, "]"));
    }
    if (t.dtype != DType::kF32) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, ".dtype must be fp32, got ", DTypeName(t.dtype)));
    }
    Bytes(plan, r.slot) = static_cast<uint64_t>(plan->bt) * 4;
  }
  if (spec.kind == LossKind::kPolicy && !Input(spec, InputSlot::kAdvantages).present) {
    return absl::InvalidArgumentError(
        "header.advantages is missing: kind policy needs one advantage per row (BT) fp32");
  }
  return absl::OkStatus();
}

// A teacher tensor of X's dtype.
absl::Status CheckTeacherDType(const TensorDesc& t, const char* name, DType dtype) {
  if (t.dtype == dtype) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(name, ".dtype ", DTypeName(t.dtype),
                                                 " differs from x.dtype ", DTypeName(dtype)));
}

// The teacher's W by handle: the caller's own, of the student's V and X's dtype.
absl::Status PlanTeacherHandle(const ComputeSpec& spec, WeightCache& weights,
                               ComputePlan* plan) {
  const std::string& handle = spec.teacher_weight_handle;
  LOSSD_RETURN_IF_ERROR(CheckIdLength(handle, "header.teacher_weight_handle"));
  if (Input(spec, InputSlot::kTeacherW).present || Input(spec, InputSlot::kTeacherBias).present) {
    return absl::InvalidArgumentError(absl::StrCat(
        "header names teacher_weight_handle '", handle, "' and also describes inline ",
        Input(spec, InputSlot::kTeacherW).present ? "teacher_w" : "teacher_bias",
        "; send one or the other (a handle carries its own bias)"));
  }
  LOSSD_ASSIGN_OR_RETURN(std::shared_ptr<const WeightEntry> entry, weights.Get(handle));
  LOSSD_RETURN_IF_ERROR(
      CheckOwner(entry->owner, spec.owner, absl::StrCat("weight handle '", handle, "'")));
  if (entry->v != plan->v || entry->h != plan->teacher_h || entry->dtype != plan->dtype) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the weights of teacher_weight_handle '", handle, "' are (V=", entry->v, ", H=",
        entry->h, ", ", DTypeName(entry->dtype), "); the teacher must be (V=", plan->v,
        ", H=", plan->teacher_h, " = teacher_x.shape[1], ", DTypeName(plan->dtype), ")"));
  }
  plan->teacher_has_bias = entry->bias != nullptr;
  plan->teacher_weights = std::move(entry);
  plan->teacher_weight_handle = handle;
  return absl::OkStatus();
}

// The teacher's W (and bias) inline: (V, Ht) and (V), of X's dtype.
absl::Status PlanTeacherInline(const ComputeSpec& spec, ComputePlan* plan) {
  const TensorDesc& w = Input(spec, InputSlot::kTeacherW);
  const TensorDesc& b = Input(spec, InputSlot::kTeacherBias);
  if (!w.present) {
    return absl::InvalidArgumentError(
        "header has neither teacher_w nor teacher_weight_handle: kind distill needs the "
        "teacher's weights");
  }
  LOSSD_RETURN_IF_ERROR(CheckShape(w, "teacher_w", 2));
  LOSSD_RETURN_IF_ERROR(CheckTeacherDType(w, "teacher_w", plan->dtype));
  if (w.shape[0] != plan->v || w.shape[1] != plan->teacher_h) {
    return absl::InvalidArgumentError(absl::StrCat(
        "teacher_w.shape ", ShapeString(w.shape), " must be (V, Ht) = [", plan->v, ", ",
        plan->teacher_h, "] (the student's V, teacher_x's hidden size)"));
  }
  const uint64_t es = DTypeSize(plan->dtype);
  Bytes(plan, InputSlot::kTeacherW) = static_cast<uint64_t>(plan->v) * plan->teacher_h * es;
  if (!b.present) return absl::OkStatus();
  LOSSD_RETURN_IF_ERROR(CheckShape(b, "teacher_bias", 1));
  LOSSD_RETURN_IF_ERROR(CheckTeacherDType(b, "teacher_bias", plan->dtype));
  if (b.shape[0] != plan->v) {
    return absl::InvalidArgumentError(absl::StrCat(
        "teacher_bias.shape ", ShapeString(b.shape), " must be (V) = [", plan->v, "]"));
  }
  Bytes(plan, InputSlot::kTeacherBias) = static_cast<uint64_t>(plan->v) * es;
  plan->teacher_has_bias = true;
  return absl::OkStatus();
}

// kDistill's teacher as its top-k: ids (BT, k) int32 or int64 and log-probs (BT, k) fp32,
// k in [1, min(V, kMaxDistillTopk)], and no teacher head beside them.
absl::Status PlanTeacherTopk(const ComputeSpec& spec, ComputePlan* plan) {
  const TensorDesc& ids = Input(spec, InputSlot::kTeacherTopkIds);
  const TensorDesc& lp = Input(spec, InputSlot::kTeacherTopkLogp);
  const InputSlot head[] = {InputSlot::kTeacherX, InputSlot::kTeacherW, InputSlot::kTeacherBias};
  for (InputSlot s : head) {
    if (Input(spec, s).present) {
      return absl::InvalidArgumentError(absl::StrCat(
          "header has teacher_topk_ids / teacher_topk_logp and also ", InputSlotName(s),
          ": send the teacher's top-k or its head, not both"));
    }
  }
  if (!spec.teacher_weight_handle.empty()) {
    return absl::InvalidArgumentError(
        "header has teacher_topk_ids / teacher_topk_logp and also teacher_weight_handle: send "
        "the teacher's top-k or its head, not both");
  }
  if (!ids.present || !lp.present) {
    return absl::InvalidArgumentError(absl::StrCat(
        "header.", ids.present ? "teacher_topk_logp" : "teacher_topk_ids",
        " is missing: a top-k teacher sends both its ids and their log-probs (BT, k)"));
  }
  LOSSD_RETURN_IF_ERROR(CheckShape(ids, "teacher_topk_ids", 2));
  LOSSD_RETURN_IF_ERROR(CheckShape(lp, "teacher_topk_logp", 2));
  const int64_t k = ids.shape[1], max_k = std::min(plan->v, kMaxDistillTopk);
  if (ids.shape[0] != plan->bt || k < 1 || k > max_k) {
    return absl::InvalidArgumentError(absl::StrCat(
        "teacher_topk_ids.shape ", ShapeString(ids.shape), " must be (BT, k) with BT = ",
        plan->bt, " and k in [1, ", max_k, "] (at most V = ", plan->v, " and ",
        kMaxDistillTopk, ")"));
  }
  if (lp.shape != ids.shape) {
    return absl::InvalidArgumentError(absl::StrCat("teacher_topk_logp.shape ",
                                                   ShapeString(lp.shape),
                                                   " must equal teacher_topk_ids.shape ",
                                                   ShapeString(ids.shape)));
  }
  if (ids.dtype != DType::kI32 && ids.dtype != DType::kI64) {
    return absl::InvalidArgumentError(absl::StrCat(
        "teacher_topk_ids.dtype must be int32 or int64, got ", DTypeName(ids.dtype)));
  }
  if (lp.dtype != DType::kF32) {
    return absl::InvalidArgumentError(
        absl::StrCat("teacher_topk_logp.dtype must be fp32, got ", DTypeName(lp.dtype)));
  }
  const uint64_t n = static_cast<uint64_t>(plan->bt) * static_cast<uint64_t>(k);
  Bytes(plan, InputSlot::kTeacherTopkIds) = n * DTypeSize(ids.dtype);
  Bytes(plan, InputSlot::kTeacherTopkLogp) = n * 4;
  plan->teacher_topk = k;
  plan->teacher_topk_id_dtype = ids.dtype;
  return absl::OkStatus();
}

bool HasTopk(const ComputeSpec& spec) {
  return Input(spec, InputSlot::kTeacherTopkIds).present ||
         Input(spec, InputSlot::kTeacherTopkLogp).present;
}

// kDistill's teacher: teacher_x (BT, Ht) of X's dtype, and its W inline or by handle; or its
// top-k. Other kinds take none of it.
absl::Status PlanTeacher(const ComputeSpec& spec, int64_t max_h, WeightCache& weights,
                         ComputePlan* plan) {
  const TensorDesc& tx = Input(spec, InputSlot::kTeacherX);
  if (spec.kind == LossKind::kDistill && HasTopk(spec)) return PlanTeacherTopk(spec, plan);
  if (spec.kind == LossKind::kDistill && spec.distill.topk_tail != DistillTopkTail::kBucket) {
    return absl::InvalidArgumentError(absl::StrCat(
        "header.distill.topk_tail ", DistillTopkTailName(spec.distill.topk_tail),
        " is for a top-k teacher (teacher_topk_ids, teacher_topk_logp); this request sends "
        "a teacher head"));
  }
  if (spec.kind != LossKind::kDistill) {
    const InputSlot slots[] = {InputSlot::kTeacherX, InputSlot::kTeacherW,
                               InputSlot::kTeacherBias, InputSlot::kTeacherTopkIds,
                               InputSlot::kTeacherTopkLogp};
    for (InputSlot s : slots) {
      if (Input(spec, s).present) {
        return OtherKinds(InputSlotName(s), LossKind::kDistill, spec.kind);
      }
    }
    if (!spec.teacher_weight_handle.empty()) {
      return OtherKinds("teacher_weight_handle", LossKind::kDistill, spec.kind);
    }
    return absl::OkStatus();
  }
  if (!tx.present) {
    return absl::InvalidArgumentError(
        "header.teacher_x is missing: kind distill needs the teacher's hidden states (BT, Ht)");
  }
  LOSSD_RETURN_IF_ERROR(CheckShape(tx, "teacher_x", 2));
  LOSSD_RETURN_IF_ERROR(CheckTeacherDType(tx, "teacher_x", plan->dtype));
  if (tx.shape[0] != plan->bt) {
    return absl::InvalidArgumentError(absl::StrCat(
        "teacher_x.shape ", ShapeString(tx.shape), " must be (BT, Ht) with BT = x.shape[0] = ",
        plan->bt));
  }
  plan->teacher_h = tx.shape[1];
  if (plan->teacher_h > max_h) {
    return absl::InvalidArgumentError(absl::StrCat("teacher_x.shape ", ShapeString(tx.shape),
                                                   " has Ht=", plan->teacher_h,
                                                   ", more than the limit H <= ", max_h,
                                                   " (--max_h)"));
  }
  Bytes(plan, InputSlot::kTeacherX) =
      static_cast<uint64_t>(plan->bt) * plan->teacher_h * DTypeSize(plan->dtype);
  if (!spec.teacher_weight_handle.empty()) return PlanTeacherHandle(spec, weights, plan);
  return PlanTeacherInline(spec, plan);
}

// The outputs a kind writes: z_loss, accuracy and predictions are cross-entropy's, entropy
// is logprob's; lse is every kind's (the student's, at the temperature).
absl::Status CheckWantedOutputs(const ComputeSpec& spec) {
  const WantedOutputs& w = spec.wanted;
  if (spec.kind != LossKind::kCrossEntropy) {
    const char* ce_only = w.z_loss ? "z_loss" : w.accuracy ? "accuracy"
                          : w.predictions ? "predictions" : nullptr;
    if (ce_only != nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(
          "header.outputs.", ce_only, " is for kind cross_entropy; this request's kind is ",
          LossKindName(spec.kind)));
    }
  }
  if (w.entropy && spec.kind != LossKind::kLogprob) {
    return OtherKinds("outputs.entropy", LossKind::kLogprob, spec.kind);
  }
  return absl::OkStatus();
}

// kDistill's options beyond the divergence of a teacher head, each behind its backend bit.
absl::Status CheckDistillServed(const ComputeSpec& spec, const std::string& backend,
                                uint32_t loss_kinds) {
  if (DistillWeighted(spec.distill) && (loss_kinds & kDistillWeightsBit) == 0) {
    return absl::UnimplementedError(absl::StrCat(
        "this server's backend '", backend, "' does not compute header.distill.weight_hard_loss "
        "/ weight_soft_loss other than (0, 1) (ServerInfo.features lists distill_hard_loss "
        "where it does)"));
  }
  if (HasTopk(spec) && (loss_kinds & kDistillTopkBit) == 0) {
    return absl::UnimplementedError(absl::StrCat(
        "this server's backend '", backend, "' does not compute a top-k teacher "
        "(header.teacher_topk_ids, teacher_topk_logp; ServerInfo.features lists distill_topk "
        "where it does)"));
  }
  return absl::OkStatus();
}

// The policy options a backend computes only with their bit in loss_kinds: UNIMPLEMENTED
// naming the first one asked for that it lacks, its field and the feature that announces it.
absl::Status CheckPolicyOptionsServed(const ComputeSpec& spec, const std::string& backend,
                                      uint32_t loss_kinds) {
  const PolicyParams& p = spec.policy;
  const struct {
    uint32_t bit;
    bool asked;
    std::string what;
    const char* feature;
  } options[] = {
      {kPolicyIsRatioBit, spec.inputs[static_cast<int>(InputSlot::kIsRatio)].present,
       "header.is_ratio", "policy_is_ratio"},
      {kPolicySequenceBit, p.importance_sampling == ImportanceSampling::kSequence,
       "header.policy.importance_sampling IMPORTANCE_SAMPLING_SEQUENCE",
       "policy_sequence_importance_sampling"},
      {kPolicyGpgBit, p.loss_type == PolicyLossType::kGpg, "header.policy.loss_type gpg",
       "policy_loss_type_gpg"},
      {kPolicyGeoMeanBit, p.loss_type == PolicyLossType::kGeoMean,
       "header.policy.loss_type geo_mean", "policy_loss_type_geo_mean"},
      {kPolicyKlCovBit, p.loss_type == PolicyLossType::kKlCov, "header.policy.loss_type kl_cov",
       "policy_loss_type_kl_cov"},
      {kPolicyVespoBit, p.loss_type == PolicyLossType::kVespo, "header.policy.loss_type vespo",
       "policy_loss_type_vespo"},
      {kPolicyCispoClampBit, p.loss_type == PolicyLossType::kCispoClamp,
       "header.policy.loss_type cispo_clamp", "policy_loss_type_cispo_clamp"},
      {kPolicyKlEstimatorBit,
       p.kl_estimator != KlEstimator::kK3 || p.kl_straight_through,
       absl::StrCat("header.policy.kl_estimator ", KlEstimatorName(p.kl_estimator),
                    p.kl_straight_through ? " with kl_straight_through" : ""),
       "policy_kl_estimator"},
      {kPolicyEntropyBit, p.entropy_coeff != 0.0f,
       absl::StrCat("header.policy.entropy_coeff ", p.entropy_coeff), "policy_entropy_bonus"},
      {kPolicyAggregationBit, p.aggregation != PolicyAggregation::kLossType,
       absl::StrCat("header.policy.aggregation ", PolicyAggregationName(p.aggregation)),
       "policy_aggregation"},
  };
  for (const auto& o : options) {
    if (!o.asked || (loss_kinds & o.bit) != 0) continue;
    return absl::UnimplementedError(absl::StrCat(
        "this server's backend '", backend, "' does not compute ", o.what,
        " (ServerInfo.features lists ", o.feature, " where it does)"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckKindServed(const ComputeSpec& spec, const std::string& backend,
                             uint32_t loss_kinds) {
  const LossKind kind = spec.kind;
  const int k = static_cast<int>(kind);
  if (k < 0 || k >= kLossKinds) {
    return absl::InvalidArgumentError(absl::StrCat("header.kind ", k, " is unknown"));
  }
  if (kind == LossKind::kDistill && (loss_kinds & LossKindBit(kind)) != 0) {
    return CheckDistillServed(spec, backend, loss_kinds);
  }
  if ((loss_kinds & LossKindBit(kind)) != 0) {
    if (kind != LossKind::kPolicy) return absl::OkStatus();
    return CheckPolicyOptionsServed(spec, backend, loss_kinds);
  }
  std::string served;
  for (int i = 0; i < kLossKinds; ++i) {
    if ((loss_kinds & LossKindBit(static_cast<LossKind>(i))) == 0) continue;
    absl::StrAppend(&served, served.empty() ? "" : ", ", LossKindName(static_cast<LossKind>(i)));
  }
  return absl::UnimplementedError(absl::StrCat(
      "this server's backend '", backend, "' does not compute kind ", LossKindName(kind),
      " (it computes: ", served, "; ServerInfo.features lists loss_kind_<name> for each)"));
}

absl::Status PlanKind(const ComputeSpec& spec, int64_t max_h, WeightCache& weights,
                      ComputePlan* plan) {
  LOSSD_RETURN_IF_ERROR(CheckKindOptions(spec.kind, spec.options,
                                         Input(spec, InputSlot::kClassWeights).present,
                                         Input(spec, InputSlot::kGradOutput).present));
  LOSSD_RETURN_IF_ERROR(CheckWantedOutputs(spec));
  if (spec.kind == LossKind::kPolicy) {
    LOSSD_RETURN_IF_ERROR(CheckPolicyParams(spec.policy, plan->bt));
  }
  if (spec.kind == LossKind::kDistill) LOSSD_RETURN_IF_ERROR(CheckDistillParams(spec.distill));
  LOSSD_RETURN_IF_ERROR(PlanRowInputs(spec, plan));
  LOSSD_RETURN_IF_ERROR(PlanTeacher(spec, max_h, weights, plan));
  plan->kind = spec.kind;
  plan->policy = spec.policy;
  plan->distill = spec.distill;
  return absl::OkStatus();
}

}  // namespace lossd
