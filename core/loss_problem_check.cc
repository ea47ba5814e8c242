// SPDX-License-Identifier: Apache-2.0
#include "core/loss_problem_check.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <initializer_list>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/distill_topk_check.h"
#include "core/status_macros.h"

namespace lossd {
namespace {

bool KnownMemory(Memory m) { return m == Memory::kHost || m == Memory::kBackend; }

bool KnownKind(LossKind k) {
  return static_cast<int>(k) >= 0 && static_cast<int>(k) < kLossKinds;
}

absl::Status NotForKind(LossKind kind, const char* what) {
  return absl::InvalidArgumentError(absl::StrCat(what, " is for cross_entropy only; kind ",
                                                 LossKindName(kind), " does not take it"));
}

// A tensor of the kind `owner` given to a problem of another kind.
absl::Status CheckOnlyFor(const void* ptr, const char* field, LossKind kind,
                          std::initializer_list<LossKind> owners) {
  if (ptr == nullptr) return absl::OkStatus();
  for (LossKind k : owners) {
    if (k == kind) return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat("loss problem: ", field, " is for kind ",
                                                 LossKindName(*owners.begin()), ", not ",
                                                 LossKindName(kind)));
}

// kDistill's top-k teacher and no head beside it (its values: CheckDistillTopk, once the
// options have passed).
absl::Status CheckTopkTeacherInputs(const LossProblem& p) {
  if (p.teacher_x != nullptr || p.teacher_w != nullptr || p.teacher_bias != nullptr ||
      p.teacher_h != 0) {
    return absl::InvalidArgumentError(
        "loss problem: kind distill takes a teacher head or its top-k, not both");
  }
  return absl::OkStatus();
}

DistillTopkView TopkViewOf(const LossProblem& p) {
  DistillTopkView t;
  t.bt = p.bt;
  t.v = p.v;
  t.k = p.teacher_topk;
  t.ids = p.teacher_topk_ids;
  t.id_dtype = p.teacher_topk_id_dtype;
  t.logp = p.teacher_topk_logp;
  t.targets = p.targets;
  t.target_dtype = p.target_dtype;
  t.ignore_index = p.options.ignore_index;
  t.params = p.distill;
  return t;
}

// The inputs each kind has of its own: another kind's are refused (never silently ignored),
// its required ones must be there.
absl::Status CheckKindInputs(const LossProblem& p) {
  if (!KnownKind(p.kind)) {
    return absl::InvalidArgumentError(
        absl::StrCat("loss problem: kind ", static_cast<int>(p.kind), " is unknown"));
  }
  const LossKind k = p.kind;
  LOSSD_RETURN_IF_ERROR(CheckOnlyFor(p.class_weights, "class_weights", k,
                                     {LossKind::kCrossEntropy}));
  LOSSD_RETURN_IF_ERROR(CheckOnlyFor(p.grad_output, "grad_output", k, {LossKind::kCrossEntropy}));
  LOSSD_RETURN_IF_ERROR(CheckOnlyFor(p.dlogp, "dlogp", k, {LossKind::kLogprob}));
  LOSSD_RETURN_IF_ERROR(CheckOnlyFor(p.dentropy, "dentropy", k, {LossKind::kLogprob}));
  LOSSD_RETURN_IF_ERROR(CheckOnlyFor(p.advantages, "advantages", k, {LossKind::kPolicy}));
  LOSSD_RETURN_IF_ERROR(CheckOnlyFor(p.old_logp, "old_logp", k, {LossKind::kPolicy}));
  LOSSD_RETURN_IF_ERROR(CheckOnlyFor(p.ref_logp, "ref_logp", k, {LossKind::kPolicy}));
  LOSSD_RETURN_IF_ERROR(CheckOnlyFor(p.is_ratio, "is_ratio", k, {LossKind::kPolicy}));
  LOSSD_RETURN_IF_ERROR(CheckOnlyFor(p.teacher_x, "teacher_x", k, {LossKind::kDistill}));
  LOSSD_RETURN_IF_ERROR(CheckOnlyFor(p.teacher_w, "teacher_w", k, {LossKind::kDistill}));
  LOSSD_RETURN_IF_ERROR(CheckOnlyFor(p.teacher_bias, "teacher_bias", k, {LossKind::kDistill}));
  LOSSD_RETURN_IF_ERROR(
      CheckOnlyFor(p.teacher_topk_ids, "teacher_topk_ids", k, {LossKind::kDistill}));
  LOSSD_RETURN_IF_ERROR(
      CheckOnlyFor(p.teacher_topk_logp, "teacher_topk_logp", k, {LossKind::kDistill}));
  if (k == LossKind::kPolicy && p.bt > 0 && p.advantages == nullptr) {
    return absl::InvalidArgumentError("loss problem: kind policy needs advantages");
  }
  if (k != LossKind::kDistill) return absl::OkStatus();
  if (p.teacher_topk != 0) return CheckTopkTeacherInputs(p);
  if (p.teacher_h <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("loss problem: kind distill needs teacher_h > 0; got ", p.teacher_h));
  }
  if (p.teacher_w == nullptr || (p.bt > 0 && p.teacher_x == nullptr)) {
    return absl::InvalidArgumentError(
        "loss problem: kind distill needs teacher_x and teacher_w non-null");
  }
  if (!KnownMemory(p.teacher_w_memory)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "loss problem: teacher_w_memory ", static_cast<int>(p.teacher_w_memory),
        " is unknown"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckReduction(const LossOptions& o, bool has_grad_output) {
  if (o.reduction != Reduction::kMean && o.reduction != Reduction::kSum &&
      o.reduction != Reduction::kNone) {
    return absl::InvalidArgumentError(
        absl::StrCat("options.reduction ", static_cast<int>(o.reduction), " is unknown"));
  }
  if (has_grad_output && o.reduction != Reduction::kNone) {
    return absl::InvalidArgumentError(
        "grad_output is only accepted with reduction none (use options.grad_scale for mean "
        "and sum)");
  }
  return absl::OkStatus();
}

absl::Status CheckOptionRanges(const LossOptions& o) {
  // Written as !(in range) so that a NaN is refused too.
  if (!(o.label_smoothing >= 0.0f && o.label_smoothing <= 1.0f)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "options.label_smoothing must be in [0, 1], got ", o.label_smoothing));
  }
  if (!(o.z_loss_scale >= 0.0f) || !std::isfinite(o.z_loss_scale)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "options.lse_square_scale must be finite and >= 0, got ", o.z_loss_scale));
  }
  if (!(o.softcap >= 0.0f) || !std::isfinite(o.softcap)) {
    return absl::InvalidArgumentError(
        absl::StrCat("options.softcap must be finite and >= 0 (0 = off), got ", o.softcap));
  }
  if (!std::isfinite(o.grad_scale)) {
    return absl::InvalidArgumentError(
        absl::StrCat("options.grad_scale must be finite, got ", o.grad_scale));
  }
  if (!(o.temperature > 0.0f) || !std::isfinite(o.temperature)) {
    return absl::InvalidArgumentError(
        absl::StrCat("options.temperature must be finite and > 0, got ", o.temperature));
  }
  return absl::OkStatus();
}

absl::Status CheckKindOptions(LossKind kind, const LossOptions& o, bool has_class_weights,
                              bool has_grad_output) {
  if (!KnownKind(kind)) {
    return absl::InvalidArgumentError(
        absl::StrCat("kind ", static_cast<int>(kind), " is unknown"));
  }
  if (kind == LossKind::kCrossEntropy) {
    // != 1 so that a NaN is refused too.
    if (!(o.temperature == 1.0f)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "options.temperature ", o.temperature, " applies to kinds logprob, policy and "
          "distill; cross_entropy takes 1 (scale the logits by the head instead)"));
    }
    return absl::OkStatus();
  }
  if (has_class_weights) return NotForKind(kind, "class_weights");
  if (has_grad_output) return NotForKind(kind, "grad_output");
  if (o.reduction != Reduction::kMean) {
    return absl::InvalidArgumentError(absl::StrCat(
        "options.reduction ", static_cast<int>(o.reduction), " is for cross_entropy only; kind ",
        LossKindName(kind), " takes mean (0), its own reduction"));
  }
  if (o.label_smoothing != 0.0f) {
    return absl::InvalidArgumentError(absl::StrCat(
        "options.label_smoothing ", o.label_smoothing, " is for cross_entropy only; kind ",
        LossKindName(kind), " takes 0"));
  }
  if (o.z_loss_scale != 0.0f) {
    return absl::InvalidArgumentError(absl::StrCat(
        "options.lse_square_scale ", o.z_loss_scale, " is for cross_entropy only; kind ",
        LossKindName(kind), " takes 0"));
  }
  if (o.token_scaling) return NotForKind(kind, "options.token_scaling");
  // != 0 so that a NaN is refused too. Both backends compute distill without a softcap (so
  // does its reference, and LigerFusedLinearJSD has none).
  if (kind == LossKind::kDistill && !(o.softcap == 0.0f)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "options.softcap ", o.softcap, " is not computed for kind distill; it takes 0"));
  }
  return absl::OkStatus();
}

// verl's menu: the KL estimator, the entropy bonus, the aggregation and its L.
absl::Status CheckPolicyVerlParams(const PolicyParams& p) {
  const int estimator = static_cast<int>(p.kl_estimator);
  if (estimator < 0 || estimator >= kKlEstimators) {
    return absl::InvalidArgumentError(absl::StrCat(
        "policy.kl_estimator ", estimator, " is unknown (k3 0, k1 1, k2 2, abs 3, low_var_kl 4)"));
  }
  if (!std::isfinite(p.entropy_coeff)) {
    return absl::InvalidArgumentError(
        absl::StrCat("policy.entropy_coeff must be finite, got ", p.entropy_coeff));
  }
  const int aggregation = static_cast<int>(p.aggregation);
  if (aggregation < 0 || aggregation >= kPolicyAggregations) {
    return absl::InvalidArgumentError(absl::StrCat(
        "policy.aggregation ", aggregation, " is unknown (loss_type 0, token-mean 1, "
        "seq-mean-token-sum 2, seq-mean-token-mean 3, seq-mean-token-sum-norm 4)"));
  }
  if (!(p.loss_scale_factor >= 0) || !std::isfinite(p.loss_scale_factor)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "policy.loss_scale_factor must be finite and >= 0 (0 = the sequence length S), got ",
        p.loss_scale_factor));
  }
  if (p.loss_scale_factor != 0 && p.aggregation != PolicyAggregation::kSeqMeanTokenSumNorm) {
    return absl::InvalidArgumentError(absl::StrCat(
        "policy.loss_scale_factor ", p.loss_scale_factor,
        " is for aggregation seq-mean-token-sum-norm; this request's is ",
        PolicyAggregationName(p.aggregation)));
  }
  return absl::OkStatus();
}

// geo_mean takes each sequence's geometric mean of its own token ratios, kl_cov each token's
// ratio: no second importance-sampling level over them, and no ratio-weighted KL (their KL
// term is verl's, apart). kl_cov's share and coefficient.
absl::Status CheckGeoMeanKlCovParams(const PolicyParams& p) {
  const char* type = PolicyLossTypeName(p.loss_type);
  if (p.importance_sampling != ImportanceSampling::kToken) {
    return absl::InvalidArgumentError(absl::StrCat(
        "policy.importance_sampling sequence does not apply to loss type ", type,
        p.loss_type == PolicyLossType::kGeoMean
            ? ", which clips each token's log-ratio and takes each sequence's geometric mean "
              "itself"
            : ", which takes each token's own ratio"));
  }
  if (p.use_bias_correction_kl) {
    return absl::InvalidArgumentError(absl::StrCat(
        "policy.use_bias_correction_kl does not apply to loss type ", type,
        " (its KL term is verl's, not weighted by a ratio)"));
  }
  if (p.loss_type != PolicyLossType::kKlCov) return absl::OkStatus();
  if (!(p.kl_cov_ratio > 0 && p.kl_cov_ratio <= 1)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "policy.kl_cov_ratio must be in (0, 1] (the share of tokens penalised), got ",
        p.kl_cov_ratio));
  }
  if (!(p.ppo_kl_coef >= 0.0f) || !std::isfinite(p.ppo_kl_coef)) {
    return absl::InvalidArgumentError(
        absl::StrCat("policy.ppo_kl_coef must be finite and >= 0, got ", p.ppo_kl_coef));
  }
  return absl::OkStatus();
}

// vespo's gamma shapes and rates (checked with vespo only, as kl_cov's are).
absl::Status CheckVespoParams(const PolicyParams& p) {
  const std::pair<const char*, float> shapes[] = {{"vespo_k_pos", p.vespo_k_pos},
                                                  {"vespo_k_neg", p.vespo_k_neg}};
  for (const auto& [name, value] : shapes) {
    if (!std::isfinite(value)) {
      return absl::InvalidArgumentError(
          absl::StrCat("policy.", name, " must be finite, got ", value));
    }
  }
  const std::pair<const char*, float> rates[] = {{"vespo_lambda_pos", p.vespo_lambda_pos},
                                                 {"vespo_lambda_neg", p.vespo_lambda_neg}};
  for (const auto& [name, value] : rates) {
    if (!(value >= 0.0f) || !std::isfinite(value)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "policy.", name, " must be finite and >= 0 (a gamma rate), got ", value));
    }
  }
  return absl::OkStatus();
}

// The options of the loss types beyond dapo, grpo, bnpo and dr_grpo.
absl::Status CheckPolicyTypeParams(const PolicyParams& p) {
  const std::pair<const char*, float> temperatures[] = {
      {"sapo_temperature_pos", p.sapo_temperature_pos},
      {"sapo_temperature_neg", p.sapo_temperature_neg}};
  for (const auto& [name, value] : temperatures) {
    if (!(value > 0.0f) || !std::isfinite(value)) {
      return absl::InvalidArgumentError(
          absl::StrCat("policy.", name, " must be finite and > 0, got ", value));
    }
  }
  const int level = static_cast<int>(p.importance_sampling);
  if (level < 0 || level >= kImportanceSamplingLevels) {
    return absl::InvalidArgumentError(absl::StrCat(
        "policy.importance_sampling ", level, " is unknown (token 0, sequence 1)"));
  }
  if (p.loss_type == PolicyLossType::kGeoMean || p.loss_type == PolicyLossType::kKlCov) {
    LOSSD_RETURN_IF_ERROR(CheckGeoMeanKlCovParams(p));
  } else if (p.loss_type == PolicyLossType::kVespo &&
             p.importance_sampling != ImportanceSampling::kToken) {
    return absl::InvalidArgumentError(
        "policy.importance_sampling sequence does not apply to loss type vespo, whose weight is "
        "its sequence's already (as Liger's)");
  } else if (p.importance_sampling == ImportanceSampling::kSequence &&
             !PolicyLossTypeClips(p.loss_type)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "policy.importance_sampling sequence is for the clipped loss types (dapo, grpo, bnpo, "
        "dr_grpo, luspo); loss type ", PolicyLossTypeName(p.loss_type),
        " takes token-level ratios only"));
  }
  if (p.loss_type == PolicyLossType::kVespo) LOSSD_RETURN_IF_ERROR(CheckVespoParams(p));
  LOSSD_RETURN_IF_ERROR(CheckPolicyVerlParams(p));
  if (p.delta == 0.0f) return absl::OkStatus();
  const double hi = 1.0 + static_cast<double>(p.epsilon_high);
  if (!std::isfinite(p.delta) || !(p.delta > hi)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "policy.delta must be unset (0) or finite and > 1 + epsilon_high = ", hi, ", got ",
        p.delta));
  }
  if (!PolicyLossTypeClips(p.loss_type)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "policy.delta caps the ratio of the clipped loss types (dapo, grpo, bnpo, dr_grpo, "
        "luspo); loss type ", PolicyLossTypeName(p.loss_type), " has no clipped surrogate"));
  }
  return absl::OkStatus();
}

absl::Status CheckPolicyParams(const PolicyParams& p, int64_t bt) {
  const int t = static_cast<int>(p.loss_type);
  if (t < 0 || t >= kPolicyLossTypes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "policy.loss_type ", t,
        " is unknown (dapo 0, grpo 1, bnpo 2, dr_grpo 3, cispo 4, sapo 5, luspo 6, gpg 7, "
        "geo_mean 8, kl_cov 9, vespo 10, cispo_clamp 11)"));
  }
  const std::pair<const char*, float> ranges[] = {
      {"epsilon_low", p.epsilon_low}, {"epsilon_high", p.epsilon_high}, {"beta", p.beta}};
  for (const auto& [name, value] : ranges) {
    if (!(value >= 0.0f) || !std::isfinite(value)) {
      return absl::InvalidArgumentError(
          absl::StrCat("policy.", name, " must be finite and >= 0, got ", value));
    }
  }
  if (p.sequences <= 0 || bt % p.sequences != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "policy.sequences ", p.sequences, " must be > 0 and divide the rows (BT=", bt,
        "): the rows are that many sequences of equal length"));
  }
  if (p.loss_type == PolicyLossType::kDrGrpo ? p.max_completion_length <= 0
                                             : p.max_completion_length < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "policy.max_completion_length must be ",
        p.loss_type == PolicyLossType::kDrGrpo ? "> 0 for loss type dr_grpo" : ">= 0",
        ", got ", p.max_completion_length));
  }
  if (!(p.dapo_normalizer >= 0) || !std::isfinite(p.dapo_normalizer)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "policy.dapo_normalizer must be finite and >= 0 (0 = the mask count), got ",
        p.dapo_normalizer));
  }
  return CheckPolicyTypeParams(p);
}

absl::Status CheckDistillParams(const DistillParams& d) {
  if (!(d.jsd_beta >= 0.0f && d.jsd_beta <= 1.0f)) {
    return absl::InvalidArgumentError(
        absl::StrCat("distill.jsd_beta must be in [0, 1], got ", d.jsd_beta));
  }
  const std::pair<const char*, float> weights[] = {{"weight_hard_loss", d.weight_hard_loss},
                                                   {"weight_soft_loss", d.weight_soft_loss}};
  for (const auto& [name, value] : weights) {
    if (!(value >= 0.0f) || !std::isfinite(value)) {
      return absl::InvalidArgumentError(
          absl::StrCat("distill.", name, " must be finite and >= 0, got ", value));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckDistillTargets(const LossProblem& p) {
  if (p.distill.weight_hard_loss == 0.0f) return absl::OkStatus();  // they mark rows only
  if (p.targets == nullptr && p.bt > 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("targets are missing: distill.weight_hard_loss ", p.distill.weight_hard_loss,
                     " needs the labels of its cross-entropy term"));
  }
  return CheckTargets(p.targets, p.target_dtype, p.bt, p.v, p.options.ignore_index);
}

absl::Status CheckChunkRows(const LossOptions& o) {
  if (o.chunk_rows < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("options.chunk_rows must be >= 0 (0 = automatic), got ", o.chunk_rows));
  }
  return absl::OkStatus();
}

absl::Status CheckLossOptions(const LossOptions& o, bool has_grad_output) {
  LOSSD_RETURN_IF_ERROR(CheckReduction(o, has_grad_output));
  LOSSD_RETURN_IF_ERROR(CheckOptionRanges(o));
  return CheckChunkRows(o);
}

absl::Status CheckTargets(const void* targets, DType target_dtype, int64_t bt, int64_t v,
                          int64_t ignore_index) {
  for (int64_t i = 0; i < bt; ++i) {
    const int64_t t = LoadAsInt(targets, target_dtype, i);
    if (t != ignore_index && (t < 0 || t >= v)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "targets[", i, "] = ", t, " is outside [0, V=", v, ") and is not ignore_index (",
          ignore_index, ")"));
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateLossInputs(const LossProblem& p) {
  if (p.bt < 0 || p.h <= 0 || p.v <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "loss problem: shape must have bt >= 0, h > 0, v > 0; got bt=", p.bt, " h=", p.h,
        " v=", p.v));
  }
  if (!IsFloatDType(p.dtype)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "loss problem: dtype must be bf16, fp16 or fp32; got ", DTypeName(p.dtype)));
  }
  if (p.target_dtype != DType::kI32 && p.target_dtype != DType::kI64) {
    return absl::InvalidArgumentError(absl::StrCat(
        "loss problem: target_dtype must be int32 or int64; got ", DTypeName(p.target_dtype)));
  }
  const bool distill = p.kind == LossKind::kDistill;  // its targets only mark ignored rows
  if (p.w == nullptr ||
      (p.bt > 0 && (p.x == nullptr || (p.targets == nullptr && !distill)))) {
    return absl::InvalidArgumentError("loss problem: x, w and targets must be non-null");
  }
  if (!KnownMemory(p.w_memory)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "loss problem: w_memory ", static_cast<int>(p.w_memory), " is unknown"));
  }
  LOSSD_RETURN_IF_ERROR(CheckKindInputs(p));
  LOSSD_RETURN_IF_ERROR(CheckKindOptions(p.kind, p.options, p.class_weights != nullptr,
                                         p.grad_output != nullptr));
  LOSSD_RETURN_IF_ERROR(CheckLossOptions(p.options, p.grad_output != nullptr));
  if (p.kind == LossKind::kPolicy) LOSSD_RETURN_IF_ERROR(CheckPolicyParams(p.policy, p.bt));
  if (distill) {
    LOSSD_RETURN_IF_ERROR(CheckDistillParams(p.distill));
    LOSSD_RETURN_IF_ERROR(CheckDistillTargets(p));
    return p.teacher_topk != 0 ? CheckDistillTopk(TopkViewOf(p)) : absl::OkStatus();
  }
  return CheckTargets(p.targets, p.target_dtype, p.bt, p.v, p.options.ignore_index);
}

absl::Status ValidateLossOutputs(const LossProblem& p, const LossOutputs& out) {
  if (out.grad_dtype != p.dtype && out.grad_dtype != DType::kF32) {
    return absl::InvalidArgumentError(
        absl::StrCat("loss problem: grad_dtype must be fp32 or the input dtype ",
                     DTypeName(p.dtype), "; got ", DTypeName(out.grad_dtype)));
  }
  if (p.bias == nullptr && (out.db != nullptr || out.db_accum != nullptr)) {
    return absl::InvalidArgumentError("loss problem: db requested but the problem has no bias");
  }
  if (!KnownMemory(out.accum_memory)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "loss problem: accum_memory ", static_cast<int>(out.accum_memory), " is unknown"));
  }
  return absl::OkStatus();
}

absl::Status ValidateLossProblem(const LossProblem& p, const LossOutputs& out) {
  LOSSD_RETURN_IF_ERROR(ValidateLossInputs(p));
  return ValidateLossOutputs(p, out);
}

void DieUnlessValidProblem(const LossProblem& p, const LossOutputs* out, const char* who) {
  absl::Status s = ValidateLossInputs(p);
  if (s.ok() && out != nullptr) s = ValidateLossOutputs(p, *out);
  if (s.ok()) return;
  std::fprintf(stderr, "%s was handed a problem that was never validated: %s\n", who,
               std::string(s.message()).c_str());
  std::abort();
}

}  // namespace lossd
