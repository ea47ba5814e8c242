// SPDX-License-Identifier: Apache-2.0
#include "client/lossctl_kinds.h"

#include <cmath>
#include <optional>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "client/lossctl_heads.h"
#include "client/lossctl_inputs.h"
#include "core/loss_problem.h"
#include "core/status_macros.h"

ABSL_FLAG(std::string, kind, "cross_entropy", "compute: cross_entropy|logprob|policy|distill");
ABSL_FLAG(double, temperature, lossd::kDefaultTemperature,
          "logprob, policy, distill: logits (after the softcap) are divided by it");
ABSL_FLAG(std::string, dlogp, "", "logprob: .npy of the upstream gradient of logp (BT), fp32");
ABSL_FLAG(std::string, dentropy, "",
          "logprob: .npy of the upstream gradient of the entropy (BT), fp32");
ABSL_FLAG(std::string, advantages, "",
          "policy: .npy of the per-token advantages (BT), fp32 (default: random in (-1, 1))");
ABSL_FLAG(std::string, old_logp, "", "policy: .npy of the old policy's log-probs (BT), fp32");
ABSL_FLAG(std::string, ref_logp, "", "policy: .npy of the reference log-probs (BT), fp32");
ABSL_FLAG(std::string, is_ratio, "",
          "policy: .npy of the rollout correction (Liger's vllm_is_ratio) (BT), fp32 >= 0");
ABSL_FLAG(std::string, loss_type, "dapo",
          "policy: dapo|grpo|bnpo|dr_grpo|cispo|sapo|luspo|gpg|geo_mean|kl_cov|vespo|cispo_clamp "
          "(gpg: verl's -A logp, geo_mean: verl's GMPO, kl_cov: verl's KL-Cov, vespo: Liger's, "
          "cispo_clamp: verl's cispo; servers listing policy_loss_type_gpg / _geo_mean / "
          "_kl_cov / _vespo / _cispo_clamp)");
ABSL_FLAG(double, epsilon_low, 0.2, "policy: lower clip range");
ABSL_FLAG(double, epsilon_high, 0.2, "policy: upper clip range");
ABSL_FLAG(double, beta, 0.04, "policy: KL coefficient");
ABSL_FLAG(int64_t, sequences, 1, "policy: the rows are this many completions, sequence-major");
ABSL_FLAG(int64_t, max_completion_length, 0, "policy: dr_grpo's max completion length");
ABSL_FLAG(double, dapo_normalizer, 0,
          "policy: dapo's and cispo's normaliser (0 = this call's mask count)");
ABSL_FLAG(double, sapo_temperature_pos, 1.0, "policy: sapo's gate temperature where A > 0");
ABSL_FLAG(double, sapo_temperature_neg, 1.05, "policy: sapo's gate temperature where A <= 0");
ABSL_FLAG(double, delta, 0,
          "policy: two-sided clipping of the clipped types, r capped at delta (0 = none; "
          "else > 1 + epsilon_high)");
ABSL_FLAG(bool, use_bias_correction_kl, false, "policy: the KL term times the ratio");
ABSL_FLAG(std::string, importance_sampling, "token",
          "policy: token (each token's own ratio) or sequence (GSPO: one ratio per sequence, "
          "the clipped loss types; servers listing policy_sequence_importance_sampling)");
ABSL_FLAG(std::string, kl_estimator, "k3",
          "policy: the KL term's estimator at d = logp - ref_logp: k3 (exp(-d) + d - 1, "
          "Liger's), k1 (d), k2 (d^2 / 2), abs (|d|) or low_var_kl (verl's k3, clamped); "
          "servers listing policy_kl_estimator");
ABSL_FLAG(bool, kl_straight_through, false,
          "policy: the estimator's value with k2's gradient (verl's '+' suffix); servers "
          "listing policy_kl_estimator");
ABSL_FLAG(double, entropy_coeff, 0,
          "policy: the entropy bonus, each token's loss minus this times its entropy; servers "
          "listing policy_entropy_bonus");
ABSL_FLAG(std::string, aggregation, "loss_type",
          "policy: loss_type (the loss type's own normaliser) or verl's loss_agg_mode: "
          "token-mean, seq-mean-token-sum, seq-mean-token-mean, seq-mean-token-sum-norm "
          "(--dapo_normalizer is then the global token or sequence count); servers listing "
          "policy_aggregation");
ABSL_FLAG(double, loss_scale_factor, 0,
          "policy: seq-mean-token-sum-norm's divisor (0 = the sequence length)");
ABSL_FLAG(double, kl_cov_ratio, 0.0002,
          "policy, loss type kl_cov: the share of tokens penalised, in (0, 1]");
ABSL_FLAG(double, ppo_kl_coef, 1.0, "policy, loss type kl_cov: the penalty's coefficient");
ABSL_FLAG(double, vespo_k_pos, 2.0, "policy, loss type vespo: the gamma shape where A >= 0");
ABSL_FLAG(double, vespo_lambda_pos, 3.0,
          "policy, loss type vespo: the gamma rate where A >= 0 (>= 0)");
ABSL_FLAG(double, vespo_k_neg, 3.0, "policy, loss type vespo: the gamma shape where A < 0");
ABSL_FLAG(double, vespo_lambda_neg, 2.0,
          "policy, loss type vespo: the gamma rate where A < 0 (>= 0)");
ABSL_FLAG(double, jsd_beta, 0.5, "distill: 0 forward KL, 1 reverse KL, between: generalised JSD");
ABSL_FLAG(double, weight_hard_loss, 0.0,
          "distill: weight of the targets' cross-entropy (temperature 1), "
          "LigerFusedLinearJSDLoss's; needs the targets");
ABSL_FLAG(double, weight_soft_loss, 1.0, "distill: weight of the divergence");
ABSL_FLAG(std::string, teacher_x, "", "distill: .npy of the teacher's hidden states (BT, Ht)");
ABSL_FLAG(std::string, teacher_topk_ids, "",
          "distill without a teacher head: .npy of the teacher's top-k ids (BT, k), int32 or "
          "int64 (with --teacher_topk_logp; servers listing distill_topk)");
ABSL_FLAG(std::string, teacher_topk_logp, "",
          "distill: .npy of the log-probs of --teacher_topk_ids (BT, k), sent as fp32");
ABSL_FLAG(std::string, topk_tail, "bucket",
          "distill from the top-k: the teacher's mass outside its k ids, bucket (one more "
          "event), renormalize (both over the ids) or none (the k terms alone)");
ABSL_FLAG(std::string, teacher_w, "", "distill: .npy of the teacher's head (V, Ht)");
ABSL_FLAG(std::string, teacher_bias, "", "distill: .npy of the teacher's bias (V)");
ABSL_FLAG(std::string, teacher_weight_handle, "",
          "distill: the teacher's head uploaded with put-weights");
ABSL_FLAG(uint32_t, keep_ms, 0,
          "logprob: keep this forward on the server for its backward for this many ms (at most "
          "the server's --ticket_max_ms) and print its ticket; wants no gradient");
ABSL_FLAG(std::string, ticket, "",
          "logprob: the backward of a kept forward: sends only --dlogp and/or --dentropy");
ABSL_FLAG(int64_t, teacher_h, 0,
          "distill, random data: the teacher's hidden size (random teacher_x and teacher_w)");

namespace lossd {
namespace client {
namespace {

absl::StatusOr<LossKind> ParseKind(const std::string& s) {
  for (LossKind k : {LossKind::kCrossEntropy, LossKind::kLogprob, LossKind::kPolicy,
                     LossKind::kDistill}) {
    if (s == LossKindName(k)) return k;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "--kind must be cross_entropy, logprob, policy or distill, got '", s, "'"));
}

absl::StatusOr<PolicyLossType> ParseLossType(const std::string& s) {
  for (int t = 0; t < kPolicyLossTypes; ++t) {
    if (s == PolicyLossTypeName(static_cast<PolicyLossType>(t))) {
      return static_cast<PolicyLossType>(t);
    }
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "--loss_type must be dapo, grpo, bnpo, dr_grpo, cispo, sapo, luspo, gpg, geo_mean, "
      "kl_cov, vespo or cispo_clamp, got '", s, "'"));
}

// An enum flag by its core names (KlEstimatorName, PolicyAggregationName): the error lists them.
template <typename E>
absl::StatusOr<E> ParseNamed(const std::string& s, const char* flag, int count,
                             const char* (*name)(E)) {
  std::vector<std::string> names;
  for (int i = 0; i < count; ++i) {
    if (s == name(static_cast<E>(i))) return static_cast<E>(i);
    names.push_back(name(static_cast<E>(i)));
  }
  return absl::InvalidArgumentError(absl::StrCat(flag, " must be one of ",
                                                 absl::StrJoin(names, ", "), ", got '", s, "'"));
}

absl::StatusOr<ImportanceSampling> ParseImportanceSampling(const std::string& s) {
  for (int l = 0; l < kImportanceSamplingLevels; ++l) {
    if (s == ImportanceSamplingName(static_cast<ImportanceSampling>(l))) {
      return static_cast<ImportanceSampling>(l);
    }
  }
  return absl::InvalidArgumentError(
      absl::StrCat("--importance_sampling must be token or sequence, got '", s, "'"));
}

// Flags given that the kind does not read: refused, since they would be silently ignored.
absl::Status CheckFlagsOfOtherKinds(LossKind kind) {
  struct Given {
    LossKind kind;
    const char* flag;
    bool given;
  };
  const Given flags[] = {
      {LossKind::kLogprob, "--dlogp", !absl::GetFlag(FLAGS_dlogp).empty()},
      {LossKind::kLogprob, "--dentropy", !absl::GetFlag(FLAGS_dentropy).empty()},
      {LossKind::kLogprob, "--keep_ms", absl::GetFlag(FLAGS_keep_ms) != 0},
      {LossKind::kPolicy, "--advantages", !absl::GetFlag(FLAGS_advantages).empty()},
      {LossKind::kPolicy, "--old_logp", !absl::GetFlag(FLAGS_old_logp).empty()},
      {LossKind::kPolicy, "--ref_logp", !absl::GetFlag(FLAGS_ref_logp).empty()},
      {LossKind::kPolicy, "--is_ratio", !absl::GetFlag(FLAGS_is_ratio).empty()},
      {LossKind::kPolicy, "--loss_type", absl::GetFlag(FLAGS_loss_type) != "dapo"},
      {LossKind::kPolicy, "--epsilon_low", absl::GetFlag(FLAGS_epsilon_low) != 0.2},
      {LossKind::kPolicy, "--epsilon_high", absl::GetFlag(FLAGS_epsilon_high) != 0.2},
      {LossKind::kPolicy, "--beta", absl::GetFlag(FLAGS_beta) != 0.04},
      {LossKind::kPolicy, "--sequences", absl::GetFlag(FLAGS_sequences) != 1},
      {LossKind::kPolicy, "--max_completion_length",
       absl::GetFlag(FLAGS_max_completion_length) != 0},
      {LossKind::kPolicy, "--dapo_normalizer", absl::GetFlag(FLAGS_dapo_normalizer) != 0},
      {LossKind::kPolicy, "--sapo_temperature_pos",
       absl::GetFlag(FLAGS_sapo_temperature_pos) != 1.0},
      {LossKind::kPolicy, "--sapo_temperature_neg",
       absl::GetFlag(FLAGS_sapo_temperature_neg) != 1.05},
      {LossKind::kPolicy, "--delta", absl::GetFlag(FLAGS_delta) != 0},
      {LossKind::kPolicy, "--use_bias_correction_kl", absl::GetFlag(FLAGS_use_bias_correction_kl)},
      {LossKind::kPolicy, "--importance_sampling",
       absl::GetFlag(FLAGS_importance_sampling) != "token"},
      {LossKind::kPolicy, "--kl_estimator", absl::GetFlag(FLAGS_kl_estimator) != "k3"},
      {LossKind::kPolicy, "--kl_straight_through", absl::GetFlag(FLAGS_kl_straight_through)},
      {LossKind::kPolicy, "--entropy_coeff", absl::GetFlag(FLAGS_entropy_coeff) != 0},
      {LossKind::kPolicy, "--aggregation", absl::GetFlag(FLAGS_aggregation) != "loss_type"},
      {LossKind::kPolicy, "--loss_scale_factor", absl::GetFlag(FLAGS_loss_scale_factor) != 0},
      {LossKind::kPolicy, "--kl_cov_ratio", absl::GetFlag(FLAGS_kl_cov_ratio) != 0.0002},
      {LossKind::kPolicy, "--ppo_kl_coef", absl::GetFlag(FLAGS_ppo_kl_coef) != 1.0},
      {LossKind::kPolicy, "--vespo_k_pos", absl::GetFlag(FLAGS_vespo_k_pos) != 2.0},
      {LossKind::kPolicy, "--vespo_lambda_pos", absl::GetFlag(FLAGS_vespo_lambda_pos) != 3.0},
      {LossKind::kPolicy, "--vespo_k_neg", absl::GetFlag(FLAGS_vespo_k_neg) != 3.0},
      {LossKind::kPolicy, "--vespo_lambda_neg", absl::GetFlag(FLAGS_vespo_lambda_neg) != 2.0},
      {LossKind::kDistill, "--jsd_beta", absl::GetFlag(FLAGS_jsd_beta) != 0.5},
      {LossKind::kDistill, "--weight_hard_loss", absl::GetFlag(FLAGS_weight_hard_loss) != 0},
      {LossKind::kDistill, "--weight_soft_loss", absl::GetFlag(FLAGS_weight_soft_loss) != 1},
      {LossKind::kDistill, "--teacher_x", !absl::GetFlag(FLAGS_teacher_x).empty()},
      {LossKind::kDistill, "--teacher_topk_ids", !absl::GetFlag(FLAGS_teacher_topk_ids).empty()},
      {LossKind::kDistill, "--teacher_topk_logp",
       !absl::GetFlag(FLAGS_teacher_topk_logp).empty()},
      {LossKind::kDistill, "--topk_tail", absl::GetFlag(FLAGS_topk_tail) != "bucket"},
      {LossKind::kDistill, "--teacher_w", !absl::GetFlag(FLAGS_teacher_w).empty()},
      {LossKind::kDistill, "--teacher_bias", !absl::GetFlag(FLAGS_teacher_bias).empty()},
      {LossKind::kDistill, "--teacher_weight_handle",
       !absl::GetFlag(FLAGS_teacher_weight_handle).empty()},
      {LossKind::kDistill, "--teacher_h", absl::GetFlag(FLAGS_teacher_h) != 0},
  };
  std::vector<std::string> stray;
  for (const Given& g : flags) {
    if (g.given && g.kind != kind) {
      stray.push_back(absl::StrCat(g.flag, " (", LossKindName(g.kind), ")"));
    }
  }
  if (!stray.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("--kind=", LossKindName(kind),
                                                   " does not take ", absl::StrJoin(stray, ", ")));
  }
  return absl::OkStatus();
}

// An optional per-token fp32 input from a .npy file (converted to fp32).
absl::StatusOr<std::optional<HostTensor>> Fp32Input(const std::string& path, const char* name) {
  LOSSD_ASSIGN_OR_RETURN(auto t, ReadOptional(path));
  if (!t.has_value()) return t;
  LOSSD_ASSIGN_OR_RETURN(auto f, CastFloat(std::move(*t), DType::kF32, name));
  return std::optional<HostTensor>(std::move(f));
}

absl::Status PolicyFromFlags(ComputeRequest* r) {
  LOSSD_ASSIGN_OR_RETURN(r->policy.loss_type, ParseLossType(absl::GetFlag(FLAGS_loss_type)));
  r->policy.epsilon_low = static_cast<float>(absl::GetFlag(FLAGS_epsilon_low));
  r->policy.epsilon_high = static_cast<float>(absl::GetFlag(FLAGS_epsilon_high));
  r->policy.beta = static_cast<float>(absl::GetFlag(FLAGS_beta));
  r->policy.sequences = absl::GetFlag(FLAGS_sequences);
  r->policy.max_completion_length = absl::GetFlag(FLAGS_max_completion_length);
  r->policy.dapo_normalizer = absl::GetFlag(FLAGS_dapo_normalizer);
  r->policy.sapo_temperature_pos = static_cast<float>(absl::GetFlag(FLAGS_sapo_temperature_pos));
  r->policy.sapo_temperature_neg = static_cast<float>(absl::GetFlag(FLAGS_sapo_temperature_neg));
  r->policy.delta = static_cast<float>(absl::GetFlag(FLAGS_delta));
  r->policy.use_bias_correction_kl = absl::GetFlag(FLAGS_use_bias_correction_kl);
  LOSSD_ASSIGN_OR_RETURN(r->policy.importance_sampling,
                         ParseImportanceSampling(absl::GetFlag(FLAGS_importance_sampling)));
  LOSSD_ASSIGN_OR_RETURN(r->policy.kl_estimator,
                         ParseNamed(absl::GetFlag(FLAGS_kl_estimator), "--kl_estimator",
                                    kKlEstimators, &KlEstimatorName));
  r->policy.kl_straight_through = absl::GetFlag(FLAGS_kl_straight_through);
  r->policy.entropy_coeff = static_cast<float>(absl::GetFlag(FLAGS_entropy_coeff));
  LOSSD_ASSIGN_OR_RETURN(r->policy.aggregation,
                         ParseNamed(absl::GetFlag(FLAGS_aggregation), "--aggregation",
                                    kPolicyAggregations, &PolicyAggregationName));
  r->policy.loss_scale_factor = absl::GetFlag(FLAGS_loss_scale_factor);
  r->policy.kl_cov_ratio = absl::GetFlag(FLAGS_kl_cov_ratio);
  r->policy.ppo_kl_coef = static_cast<float>(absl::GetFlag(FLAGS_ppo_kl_coef));
  r->policy.vespo_k_pos = static_cast<float>(absl::GetFlag(FLAGS_vespo_k_pos));
  r->policy.vespo_lambda_pos = static_cast<float>(absl::GetFlag(FLAGS_vespo_lambda_pos));
  r->policy.vespo_k_neg = static_cast<float>(absl::GetFlag(FLAGS_vespo_k_neg));
  r->policy.vespo_lambda_neg = static_cast<float>(absl::GetFlag(FLAGS_vespo_lambda_neg));
  LOSSD_ASSIGN_OR_RETURN(r->advantages, Fp32Input(absl::GetFlag(FLAGS_advantages), "advantages"));
  if (!r->advantages.has_value()) {
    r->advantages = RandomFloat(DType::kF32, {r->x.dim(0)}, 1.0f, absl::GetFlag(FLAGS_seed) + 4);
  }
  LOSSD_ASSIGN_OR_RETURN(r->old_logp, Fp32Input(absl::GetFlag(FLAGS_old_logp), "old_logp"));
  LOSSD_ASSIGN_OR_RETURN(r->ref_logp, Fp32Input(absl::GetFlag(FLAGS_ref_logp), "ref_logp"));
  LOSSD_ASSIGN_OR_RETURN(r->is_ratio, Fp32Input(absl::GetFlag(FLAGS_is_ratio), "is_ratio"));
  return absl::OkStatus();
}

// A top-k teacher from .npy files: its ids as stored (the server takes int32 or int64 and
// names any other dtype) and their log-probs in fp32. Whether one was given.
absl::StatusOr<bool> TopkFromFlags(ComputeRequest* r) {
  LOSSD_ASSIGN_OR_RETURN(r->distill.topk_tail,
                         ParseNamed(absl::GetFlag(FLAGS_topk_tail), "--topk_tail",
                                    kDistillTopkTails, &DistillTopkTailName));
  LOSSD_ASSIGN_OR_RETURN(r->teacher_topk_ids, ReadOptional(absl::GetFlag(FLAGS_teacher_topk_ids)));
  LOSSD_ASSIGN_OR_RETURN(r->teacher_topk_logp,
                         Fp32Input(absl::GetFlag(FLAGS_teacher_topk_logp), "teacher_topk_logp"));
  if (r->teacher_topk_ids.has_value() != r->teacher_topk_logp.has_value()) {
    return absl::InvalidArgumentError(
        "--kind=distill: a top-k teacher takes both --teacher_topk_ids and --teacher_topk_logp");
  }
  return r->teacher_topk_ids.has_value();
}

// The teacher: its top-k (TopkFromFlags), or hidden states and head from .npy files (cast to
// X's dtype, as the server wants), the head by handle, or random (--teacher_h).
absl::Status DistillFromFlags(int64_t v, ComputeRequest* r) {
  r->distill.jsd_beta = static_cast<float>(absl::GetFlag(FLAGS_jsd_beta));
  r->distill.weight_hard_loss = static_cast<float>(absl::GetFlag(FLAGS_weight_hard_loss));
  r->distill.weight_soft_loss = static_cast<float>(absl::GetFlag(FLAGS_weight_soft_loss));
  r->teacher_weight_handle = absl::GetFlag(FLAGS_teacher_weight_handle);
  LOSSD_ASSIGN_OR_RETURN(const bool topk, TopkFromFlags(r));
  if (topk) return absl::OkStatus();  // a teacher head beside it is refused by the server
  const DType dt = r->x.dtype();
  const int64_t th = absl::GetFlag(FLAGS_teacher_h);
  const uint64_t seed = absl::GetFlag(FLAGS_seed);
  const std::pair<const char*, std::optional<HostTensor>*> files[] = {
      {"teacher_x", &r->teacher_x}, {"teacher_w", &r->teacher_w},
      {"teacher_bias", &r->teacher_bias}};
  const std::string paths[] = {absl::GetFlag(FLAGS_teacher_x), absl::GetFlag(FLAGS_teacher_w),
                               absl::GetFlag(FLAGS_teacher_bias)};
  for (int i = 0; i < 3; ++i) {
    LOSSD_ASSIGN_OR_RETURN(auto t, ReadOptional(paths[i]));
    if (!t.has_value()) continue;
    LOSSD_ASSIGN_OR_RETURN(auto c, CastFloat(std::move(*t), dt, files[i].first));
    *files[i].second = std::move(c);
  }
  if (!r->teacher_x.has_value()) {
    if (th <= 0) {
      return absl::InvalidArgumentError(
          "--kind=distill: give --teacher_x (a .npy) or a random teacher's --teacher_h");
    }
    r->teacher_x = RandomFloat(dt, {r->x.dim(0), th}, 1.0f, seed + 5);
  }
  if (!r->teacher_w.has_value() && r->teacher_weight_handle.empty()) {
    if (th <= 0 || v <= 0) {
      return absl::InvalidArgumentError(
          "--kind=distill: give --teacher_w (a .npy), --teacher_weight_handle, or a random "
          "teacher's --teacher_h (with V known)");
    }
    r->teacher_w = RandomFloat(dt, {v, th}, 9.0f / std::sqrt(static_cast<float>(th)), seed + 6);
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status KindFromFlags(int64_t v, ComputeRequest* r) {
  LOSSD_ASSIGN_OR_RETURN(r->kind, ParseKind(absl::GetFlag(FLAGS_kind)));
  LOSSD_RETURN_IF_ERROR(CheckFlagsOfOtherKinds(r->kind));
  r->options.temperature = static_cast<float>(absl::GetFlag(FLAGS_temperature));
  switch (r->kind) {
    case LossKind::kCrossEntropy:
      return absl::OkStatus();
    case LossKind::kLogprob: {
      LOSSD_ASSIGN_OR_RETURN(r->dlogp, Fp32Input(absl::GetFlag(FLAGS_dlogp), "dlogp"));
      LOSSD_ASSIGN_OR_RETURN(r->dentropy, Fp32Input(absl::GetFlag(FLAGS_dentropy), "dentropy"));
      r->keep_ms = absl::GetFlag(FLAGS_keep_ms);
      // A kept forward asks for no gradient: the default --want (dx,dw) does not apply.
      if (r->keep_ms > 0 && absl::GetFlag(FLAGS_want) == "dx,dw") {
        r->want.dx = r->want.dw = r->want.db = false;
      }
      return absl::OkStatus();
    }
    case LossKind::kPolicy:
      return PolicyFromFlags(r);
    case LossKind::kDistill:
      return DistillFromFlags(v, r);
  }
  return absl::OkStatus();
}

absl::StatusOr<ComputeRequest> BackwardFromFlags() {
  const std::string ticket = absl::GetFlag(FLAGS_ticket);
  const std::pair<const char*, bool> kept[] = {
      {"--x", !absl::GetFlag(FLAGS_x).empty()},
      {"--w", !absl::GetFlag(FLAGS_w).empty()},
      {"--bias", !absl::GetFlag(FLAGS_bias).empty()},
      {"--with_bias", absl::GetFlag(FLAGS_with_bias)},
      {"--targets", !absl::GetFlag(FLAGS_targets).empty()},
      {"--weight_handle", !absl::GetFlag(FLAGS_weight_handle).empty()},
      {"--head", !absl::GetFlag(FLAGS_head).empty()},
      {"--class_weights", !absl::GetFlag(FLAGS_class_weights).empty()},
      {"--grad_output", !absl::GetFlag(FLAGS_grad_output).empty()},
      {"--keep_ms", absl::GetFlag(FLAGS_keep_ms) != 0}};
  for (const auto& [flag, given] : kept) {
    if (given) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--ticket=", ticket, " with ", flag, ": a backward sends only --dlogp and/or "
          "--dentropy (X, the targets and the weight are the ticket's)"));
    }
  }
  const std::string kind = absl::GetFlag(FLAGS_kind);
  if (kind != "cross_entropy" && kind != "logprob") {  // cross_entropy: the flag's default
    return absl::InvalidArgumentError(absl::StrCat(
        "--ticket names a two-phase logprob forward; --kind=", kind, " does not take it"));
  }
  LOSSD_RETURN_IF_ERROR(CheckFlagsOfOtherKinds(LossKind::kLogprob));
  ComputeRequest r;
  LOSSD_RETURN_IF_ERROR(LossOptionsFromFlags(&r));
  r.kind = LossKind::kLogprob;
  r.ticket = ticket;
  r.accumulator = absl::GetFlag(FLAGS_accumulator);
  r.rank = absl::GetFlag(FLAGS_rank);
  r.micro_batch = absl::GetFlag(FLAGS_micro_batch);
  LOSSD_ASSIGN_OR_RETURN(r.dlogp, Fp32Input(absl::GetFlag(FLAGS_dlogp), "dlogp"));
  LOSSD_ASSIGN_OR_RETURN(r.dentropy, Fp32Input(absl::GetFlag(FLAGS_dentropy), "dentropy"));
  if (!r.dlogp.has_value() && !r.dentropy.has_value()) {
    return absl::InvalidArgumentError(
        "--ticket: give the upstream gradients, --dlogp and/or --dentropy (.npy, (BT))");
  }
  return r;
}

void PrintKindResult(const ComputeRequest& r, const ComputeResult& res, CommandOutput& out) {
  if (!res.ticket.empty()) {
    out.Field("ticket", res.ticket,
              absl::StrFormat("ticket      %s (expires at %d ms since the epoch; its backward: "
                              "lossctl compute --ticket=%s --dlogp=...)",
                              res.ticket, res.ticket_expires_unix_ms, res.ticket));
    out.Field("ticket_expires_unix_ms", res.ticket_expires_unix_ms, "");
  }
  if (r.kind != LossKind::kPolicy) return;
  out.Field("kl", static_cast<double>(res.kl), absl::StrFormat("kl          %.7g", res.kl));
  out.Field("clip_fraction", static_cast<double>(res.clip_fraction),
            absl::StrFormat("clip_frac   %.7g", res.clip_fraction));
}

}  // namespace client
}  // namespace lossd
