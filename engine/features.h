// SPDX-License-Identifier: Apache-2.0
// The feature names ServerInfo announces: one per addition to lossd.v1 that an older server
// would not honour. Never reuse or rename a name; a client tests for one before it sends the
// field the feature adds (an older server refuses unknown fields, see wire_convert).
#ifndef LOSSD_ENGINE_FEATURES_H_
#define LOSSD_ENGINE_FEATURES_H_

#include <algorithm>
#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/loss_problem.h"

namespace lossd {

// Sorted, one line each, with what a client may rely on when it is listed.
inline constexpr std::array<std::string_view, 7> kServerFeatures = {
    // Hosted heads: CreateHead, Step, ExportHead, GetHeadInfo, DropHead, ComputeHeader.head
    // and its fields, ComputeSummary.head_version / head_added, StateEntry STATE_HEAD.
    "hosted_head",
    // The List RPC: the caller's own weight handles and accumulators, sizes and last use.
    "list_state",
    // ComputeHeader.allow_nonfinite_loss: a loss that overflowed fp32 from finite inputs is
    // answered (inf or NaN, with its gradients) instead of refused, except into an
    // accumulator or a head.
    "nonfinite_loss",
    // ComputeSummary.nonfinite names the gradients holding NaN or Inf after a Compute, and an
    // accumulator whose sum became non-finite refuses later Computes and fetches
    // (FAILED_PRECONDITION naming the micro-batch) until a reset fetch or a drop.
    "nonfinite_outputs",
    // Weight handles and accumulators belong to the credential that created them (bearer
    // token, or verified client certificate); others get PERMISSION_DENIED. Without auth,
    // state is anyone's.
    "owned_state",
    // The server refuses a request that carries a field it does not know (INVALID_ARGUMENT
    // naming the message and the field number) instead of ignoring it.
    "refuse_unknown_fields",
    // LossOptions.token_scaling (Liger's use_token_scaling) is honoured.
    "token_scaling",
};

// ServerInfo.features of a server whose backend computes `loss_kinds` (BackendInfo): the
// list above and, for each kind beyond cross-entropy the backend computes,
// "loss_kind_<name>" ("loss_kind_logprob", "loss_kind_policy", "loss_kind_distill"): the
// ComputeHeader.kind and its fields are honoured for that kind; with logprob also
// "logprob_two_phase": ComputeHeader.keep_ms and ticket, ComputeSummary.ticket and
// ticket_expires_unix_ms, StateEntry STATE_TICKET (engine/tickets.h); with policy and
// kPolicySequenceBit "policy_sequence_importance_sampling": PolicyOptions.importance_sampling
// IMPORTANCE_SAMPLING_SEQUENCE (GSPO) is computed; with kPolicyIsRatioBit "policy_is_ratio":
// ComputeHeader.is_ratio (TENSOR_IS_RATIO) is honoured; verl's menu, each with its bit:
// "policy_kl_estimator" (PolicyOptions.kl_estimator, kl_straight_through),
// "policy_entropy_bonus" (entropy_coeff), "policy_aggregation" (aggregation,
// loss_scale_factor), "policy_loss_type_gpg" (POLICY_LOSS_GPG); with distill and
// kDistillWeightsBit "distill_hard_loss": DistillOptions.weight_hard_loss / weight_soft_loss
// are honoured; with kDistillTopkBit "distill_topk": ComputeHeader.teacher_topk_ids /
// teacher_topk_logp (a top-k teacher) and DistillOptions.topk_tail are honoured. Sorted.
inline std::vector<std::string> ServerFeatures(uint32_t loss_kinds) {
  std::vector<std::string> features(kServerFeatures.begin(), kServerFeatures.end());
  for (int k = 1; k < kLossKinds; ++k) {
    const LossKind kind = static_cast<LossKind>(k);
    if ((loss_kinds & LossKindBit(kind)) != 0) {
      features.push_back(std::string("loss_kind_") + LossKindName(kind));
      if (kind == LossKind::kLogprob) features.push_back("logprob_two_phase");
      if (kind == LossKind::kPolicy && (loss_kinds & kPolicySequenceBit) != 0) {
        features.push_back("policy_sequence_importance_sampling");
      }
      if (kind == LossKind::kPolicy && (loss_kinds & kPolicyIsRatioBit) != 0) {
        features.push_back("policy_is_ratio");
      }
      const std::pair<uint32_t, const char*> verl[] = {
          {kPolicyKlEstimatorBit, "policy_kl_estimator"},
          {kPolicyEntropyBit, "policy_entropy_bonus"},
          {kPolicyAggregationBit, "policy_aggregation"},
          {kPolicyGpgBit, "policy_loss_type_gpg"},
          {kPolicyGeoMeanBit, "policy_loss_type_geo_mean"},
          {kPolicyKlCovBit, "policy_loss_type_kl_cov"},
          {kPolicyVespoBit, "policy_loss_type_vespo"},
          {kPolicyCispoClampBit, "policy_loss_type_cispo_clamp"}};
      for (const auto& [bit, name] : verl) {
        if (kind == LossKind::kPolicy && (loss_kinds & bit) != 0) features.push_back(name);
      }
      if (kind == LossKind::kDistill && (loss_kinds & kDistillWeightsBit) != 0) {
        features.push_back("distill_hard_loss");
      }
      if (kind == LossKind::kDistill && (loss_kinds & kDistillTopkBit) != 0) {
        features.push_back("distill_topk");
      }
    }
  }
  std::sort(features.begin(), features.end());
  return features;
}

}  // namespace lossd

#endif  // LOSSD_ENGINE_FEATURES_H_
