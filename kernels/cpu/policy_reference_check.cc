// SPDX-License-Identifier: Apache-2.0
#include "kernels/cpu/policy_reference_check.h"

#include <cmath>
#include <cstdint>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "core/dtype.h"
#include "core/loss_problem.h"
#include "kernels/cpu/policy_reference.h"
#include "kernels/cpu/reference_head.h"

namespace lossd {
namespace {

// The options of verl's menu: the KL estimator, the entropy bonus, the aggregation.
absl::Status CheckVerlOptions(const PolicyOptions& o) {
  const int32_t estimator = static_cast<int32_t>(o.kl_estimator);
  if (estimator < 0 || estimator >= kKlEstimators) {
    return absl::InvalidArgumentError(absl::StrCat(
        "options.kl_estimator ", estimator, " is not k3, k1, k2, abs or low_var_kl"));
  }
  if (!std::isfinite(o.entropy_coeff)) {
    return absl::InvalidArgumentError(
        absl::StrCat("options.entropy_coeff must be finite, got ", o.entropy_coeff));
  }
  const int32_t aggregation = static_cast<int32_t>(o.aggregation);
  if (aggregation < 0 || aggregation >= kPolicyAggregations) {
    return absl::InvalidArgumentError(absl::StrCat(
        "options.aggregation ", aggregation, " is not loss_type, token-mean, seq-mean-token-sum, "
        "seq-mean-token-mean or seq-mean-token-sum-norm"));
  }
  if (!(o.loss_scale_factor >= 0) || !std::isfinite(o.loss_scale_factor)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "options.loss_scale_factor must be finite and >= 0 (0 = S), got ", o.loss_scale_factor));
  }
  return absl::OkStatus();
}

absl::Status CheckOptions(const PolicyOptions& o) {
  const int32_t type = static_cast<int32_t>(o.loss_type);
  if (type < 0 || type >= kPolicyLossTypes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "options.loss_type ", type,
        " is not dapo, grpo, bnpo, dr_grpo, cispo, sapo, luspo, gpg, geo_mean, kl_cov, vespo or "
        "cispo_clamp"));
  }
  const struct {
    const char* name;
    float value;
  } nonnegative[] = {{"epsilon_low", o.epsilon_low},
                     {"epsilon_high", o.epsilon_high},
                     {"beta", o.beta}};
  for (const auto& f : nonnegative) {
    if (!(f.value >= 0.0f) || !std::isfinite(f.value)) {
      return absl::InvalidArgumentError(
          absl::StrCat("options.", f.name, " must be finite and >= 0, got ", f.value));
    }
  }
  if (absl::Status s = CheckTemperatureAndSoftcap(o.temperature, o.softcap); !s.ok()) return s;
  const std::pair<const char*, float> temperatures[] = {
      {"sapo_temperature_pos", o.sapo_temperature_pos},
      {"sapo_temperature_neg", o.sapo_temperature_neg}};
  for (const auto& [name, value] : temperatures) {
    if (!(value > 0.0f) || !std::isfinite(value)) {
      return absl::InvalidArgumentError(
          absl::StrCat("options.", name, " must be finite and > 0, got ", value));
    }
  }
  if (o.delta != 0.0f) {
    const double hi = 1.0 + static_cast<double>(o.epsilon_high);
    if (!std::isfinite(o.delta) || !(o.delta > hi)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "options.delta must be 0 (none) or finite and > 1 + epsilon_high = ", hi, ", got ",
          o.delta));
    }
    if (!PolicyLossTypeClips(o.loss_type)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "options.delta applies to the clipped loss types; loss_type ",
          PolicyLossTypeName(o.loss_type), " has no clipped surrogate"));
    }
  }
  const int32_t level = static_cast<int32_t>(o.importance_sampling);
  if (level < 0 || level >= kImportanceSamplingLevels) {
    return absl::InvalidArgumentError(absl::StrCat(
        "options.importance_sampling ", level, " is not token (0) or sequence (1)"));
  }
  if ((o.loss_type == PolicyLossType::kGeoMean || o.loss_type == PolicyLossType::kKlCov) &&
      (o.importance_sampling != ImportanceSampling::kToken || o.use_bias_correction_kl)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "options.importance_sampling sequence and options.use_bias_correction_kl do not apply "
        "to loss_type ", PolicyLossTypeName(o.loss_type)));
  }
  if (o.loss_type == PolicyLossType::kKlCov &&
      (!(o.kl_cov_ratio > 0 && o.kl_cov_ratio <= 1) || !(o.ppo_kl_coef >= 0.0f) ||
       !std::isfinite(o.ppo_kl_coef))) {
    return absl::InvalidArgumentError(absl::StrCat(
        "options.kl_cov_ratio must be in (0, 1] and options.ppo_kl_coef finite and >= 0, got ",
        o.kl_cov_ratio, " and ", o.ppo_kl_coef));
  }
  if (o.loss_type == PolicyLossType::kVespo &&
      (!std::isfinite(o.vespo_k_pos) || !std::isfinite(o.vespo_k_neg) ||
       !(o.vespo_lambda_pos >= 0.0f) || !std::isfinite(o.vespo_lambda_pos) ||
       !(o.vespo_lambda_neg >= 0.0f) || !std::isfinite(o.vespo_lambda_neg))) {
    return absl::InvalidArgumentError(absl::StrCat(
        "options.vespo_k_pos and _k_neg must be finite, options.vespo_lambda_pos and "
        "_lambda_neg finite and >= 0, got ", o.vespo_k_pos, ", ", o.vespo_k_neg, ", ",
        o.vespo_lambda_pos, ", ", o.vespo_lambda_neg));
  }
  if (o.importance_sampling == ImportanceSampling::kSequence && !PolicyLossTypeClips(o.loss_type)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "options.importance_sampling sequence applies to the clipped loss types; loss_type ",
        PolicyLossTypeName(o.loss_type), " takes token-level ratios only"));
  }
  if (o.loss_type == PolicyLossType::kDrGrpo ? o.max_completion_length <= 0
                                             : o.max_completion_length < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "options.max_completion_length must be > 0 with loss_type dr_grpo (>= 0 otherwise), got ",
        o.max_completion_length, " with ", PolicyLossTypeName(o.loss_type)));
  }
  if (!(o.dapo_normalizer >= 0) || !std::isfinite(o.dapo_normalizer)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "options.dapo_normalizer must be finite and >= 0 (0 = the mask count), got ",
        o.dapo_normalizer));
  }
  if (!std::isfinite(o.grad_scale)) {
    return absl::InvalidArgumentError(
        absl::StrCat("options.grad_scale must be finite, got ", o.grad_scale));
  }
  return CheckVerlOptions(o);
}

// Mask values, and the targets of the rows that count (the others are never read).
absl::Status CheckMaskAndTargets(const PolicyProblem& p) {
  const int64_t bt = p.head.bt, v = p.head.v;
  if (p.targets == nullptr) return absl::InvalidArgumentError("targets must be non-null");
  if (p.target_dtype != DType::kI32 && p.target_dtype != DType::kI64) {
    return absl::InvalidArgumentError(
        absl::StrCat("targets: dtype must be int32 or int64, got ", DTypeName(p.target_dtype)));
  }
  for (int64_t i = 0; i < bt; ++i) {
    if (p.mask != nullptr && p.mask[i] > 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("mask[", i, "] must be 0 or 1, got ", static_cast<int>(p.mask[i])));
    }
    if (p.mask != nullptr && p.mask[i] == 0) continue;
    const int64_t t = LoadAsInt(p.targets, p.target_dtype, i);
    if (t < 0 || t >= v) {
      return absl::InvalidArgumentError(absl::StrCat(
          "targets[", i, "] = ", t, " is outside [0, ", v, ") on a row whose mask is 1"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckPolicyProblem(const PolicyProblem& p) {
  if (absl::Status s = CheckHeadInputs(p.head, "head"); !s.ok()) return s;
  if (absl::Status s = CheckOptions(p.options); !s.ok()) return s;
  if (p.batch <= 0 || p.head.bt % p.batch != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "batch must be > 0 and divide the row count ", p.head.bt, ", got ", p.batch));
  }
  if (absl::Status s = CheckMaskAndTargets(p); !s.ok()) return s;
  if (p.advantages == nullptr) return absl::InvalidArgumentError("advantages must be non-null");
  const int64_t bt = p.head.bt;
  for (const auto& [values, name] : {std::make_pair(p.advantages, "advantages"),
                                     std::make_pair(p.old_logp, "old_logp"),
                                     std::make_pair(p.ref_logp, "ref_logp"),
                                     std::make_pair(p.is_ratio, "is_ratio")}) {
    if (absl::Status s = CheckFinite(values, bt, name); !s.ok()) return s;
  }
  for (int64_t i = 0; p.is_ratio != nullptr && i < bt; ++i) {
    if (!(p.is_ratio[i] >= 0.0f)) {
      return absl::InvalidArgumentError(
          absl::StrCat("is_ratio[", i, "] must be >= 0, got ", p.is_ratio[i]));
    }
  }
  return absl::OkStatus();
}

}  // namespace lossd
