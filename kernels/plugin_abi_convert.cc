// SPDX-License-Identifier: Apache-2.0
#include "kernels/plugin_abi_convert.h"

#include <cstdio>
#include <cstring>
#include <string>
#include <type_traits>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "core/loss_problem.h"

namespace lossd {
namespace {

// The ABI's enumeration values are core/loss_problem.h's (Cast moves them by value).
static_assert(LOSSD_POLICY_LUSPO == static_cast<int>(PolicyLossType::kLuspo) &&
                  LOSSD_POLICY_GPG == static_cast<int>(PolicyLossType::kGpg) &&
                  LOSSD_POLICY_GEO_MEAN == static_cast<int>(PolicyLossType::kGeoMean) &&
                  LOSSD_POLICY_KL_COV == static_cast<int>(PolicyLossType::kKlCov) &&
                  LOSSD_POLICY_VESPO == static_cast<int>(PolicyLossType::kVespo) &&
                  LOSSD_POLICY_CISPO_CLAMP == static_cast<int>(PolicyLossType::kCispoClamp) &&
                  kPolicyLossTypes == LOSSD_POLICY_CISPO_CLAMP + 1,
              "LOSSD_POLICY_* are PolicyLossType's values");
static_assert(LOSSD_IMPORTANCE_SAMPLING_SEQUENCE ==
                      static_cast<int>(ImportanceSampling::kSequence) &&
                  kImportanceSamplingLevels == 2,
              "LOSSD_IMPORTANCE_SAMPLING_* are ImportanceSampling's values");
static_assert(LOSSD_KL_K3 == static_cast<int>(KlEstimator::kK3) &&
                  LOSSD_KL_K1 == static_cast<int>(KlEstimator::kK1) &&
                  LOSSD_KL_K2 == static_cast<int>(KlEstimator::kK2) &&
                  LOSSD_KL_ABS == static_cast<int>(KlEstimator::kAbs) &&
                  LOSSD_KL_LOW_VAR_KL == static_cast<int>(KlEstimator::kLowVarKl) &&
                  kKlEstimators == 5,
              "LOSSD_KL_* are KlEstimator's values");
static_assert(LOSSD_AGGREGATION_TOKEN_MEAN == static_cast<int>(PolicyAggregation::kTokenMean) &&
                  LOSSD_AGGREGATION_SEQ_MEAN_TOKEN_SUM ==
                      static_cast<int>(PolicyAggregation::kSeqMeanTokenSum) &&
                  LOSSD_AGGREGATION_SEQ_MEAN_TOKEN_MEAN ==
                      static_cast<int>(PolicyAggregation::kSeqMeanTokenMean) &&
                  LOSSD_AGGREGATION_SEQ_MEAN_TOKEN_SUM_NORM ==
                      static_cast<int>(PolicyAggregation::kSeqMeanTokenSumNorm) &&
                  kPolicyAggregations == 5,
              "LOSSD_AGGREGATION_* are PolicyAggregation's values");

// NUL-terminated `s` in dst[0, capacity), cut to fit.
void CopyCut(absl::string_view s, char* dst, size_t capacity) {
  if (dst == nullptr || capacity == 0) return;
  const size_t n = s.size() < capacity - 1 ? s.size() : capacity - 1;
  std::memcpy(dst, s.data(), n);
  dst[n] = '\0';
}

// One field from one side's type to the other's: an enum to or from its int32_t, a flag
// (C's int32_t, where any nonzero value is true) to or from bool, the rest as they are.
template <typename To, typename From>
To Cast(From v) {
  if constexpr (std::is_same_v<To, bool>) {
    return v != 0;
  } else {
    return static_cast<To>(v);
  }
}

// The two directions. Each struct pair's fields are listed once, in a Visit* below that hands
// every (C++ field, C field) to one of these, so that ToC and FromC cannot drift apart.
struct IntoC {
  template <typename Cpp, typename C>
  void operator()(const Cpp& cpp, C& c) const {
    c = Cast<C>(cpp);
  }
};

struct OutOfC {
  template <typename Cpp, typename C>
  void operator()(Cpp& cpp, const C& c) const {
    cpp = Cast<Cpp>(c);
  }
};

template <typename S, typename C, typename Move>
void VisitWorkspaceShape(S& s, C& c, Move move) {
  move(s.bt, c.bt);
  move(s.h, c.h);
  move(s.v, c.v);
  move(s.dtype, c.dtype);
  move(s.grad_dtype, c.grad_dtype);
  move(s.w_memory, c.w_memory);
  move(s.has_bias, c.has_bias);
  move(s.has_class_weights, c.has_class_weights);
  move(s.has_grad_output, c.has_grad_output);
  move(s.rows_streamed, c.rows_streamed);
  move(s.chunk_rows, c.chunk_rows);
  move(s.want_dx, c.want_dx);
  move(s.dw, c.dw);
  move(s.db, c.db);
  move(s.accum_memory, c.accum_memory);
  move(s.kind, c.kind);
  move(s.teacher_h, c.teacher_h);
  move(s.teacher_w_memory, c.teacher_w_memory);
  move(s.want_entropy, c.want_entropy);
}

template <typename O, typename C, typename Move>
void VisitOptions(O& o, C& c, Move move) {
  move(o.ignore_index, c.ignore_index);
  move(o.reduction, c.reduction);
  move(o.label_smoothing, c.label_smoothing);
  move(o.z_loss_scale, c.z_loss_scale);
  move(o.softcap, c.softcap);
  move(o.grad_scale, c.grad_scale);
  move(o.chunk_rows, c.chunk_rows);
  move(o.token_scaling, c.token_scaling);
  move(o.temperature, c.temperature);
}

template <typename P, typename C, typename Move>
void VisitPolicy(P& p, C& c, Move move) {
  move(p.loss_type, c.loss_type);
  move(p.epsilon_low, c.epsilon_low);
  move(p.epsilon_high, c.epsilon_high);
  move(p.beta, c.beta);
  move(p.sequences, c.sequences);
  move(p.max_completion_length, c.max_completion_length);
  move(p.dapo_normalizer, c.dapo_normalizer);
  move(p.sapo_temperature_pos, c.sapo_temperature_pos);
  move(p.sapo_temperature_neg, c.sapo_temperature_neg);
  move(p.delta, c.delta);
  move(p.use_bias_correction_kl, c.use_bias_correction_kl);
}

// Everything but the options and the policy's parameters (structs of their own) and the row
// stream (an adapter each side makes).
template <typename P, typename C, typename Move>
void VisitProblem(P& p, C& c, Move move) {
  move(p.bt, c.bt);
  move(p.h, c.h);
  move(p.v, c.v);
  move(p.dtype, c.dtype);
  move(p.w_memory, c.w_memory);
  move(p.x, c.x);
  move(p.w, c.w);
  move(p.bias, c.bias);
  move(p.targets, c.targets);
  move(p.target_dtype, c.target_dtype);
  move(p.class_weights, c.class_weights);
  move(p.grad_output, c.grad_output);
  move(p.kind, c.kind);
  move(p.dlogp, c.dlogp);
  move(p.dentropy, c.dentropy);
  move(p.advantages, c.advantages);
  move(p.old_logp, c.old_logp);
  move(p.ref_logp, c.ref_logp);
  move(p.teacher_h, c.teacher_h);
  move(p.teacher_w_memory, c.teacher_w_memory);
  move(p.teacher_x, c.teacher_x);
  move(p.teacher_w, c.teacher_w);
  move(p.teacher_bias, c.teacher_bias);
  move(p.distill.jsd_beta, c.distill.jsd_beta);
#if LOSSD_PLUGIN_ABI_MINOR >= 3
  move(p.is_ratio, c.is_ratio);
  move(p.policy.importance_sampling, c.importance_sampling);
  move(p.policy.kl_estimator, c.kl_estimator);
  move(p.policy.kl_straight_through, c.kl_straight_through);
  move(p.policy.entropy_coeff, c.entropy_coeff);
  move(p.policy.aggregation, c.aggregation);
  move(p.policy.loss_scale_factor, c.loss_scale_factor);
  move(p.distill.weight_hard_loss, c.distill_weight_hard_loss);
  move(p.distill.weight_soft_loss, c.distill_weight_soft_loss);
#endif
#if LOSSD_PLUGIN_ABI_MINOR >= 4
  move(p.policy.kl_cov_ratio, c.kl_cov_ratio);
  move(p.policy.ppo_kl_coef, c.ppo_kl_coef);
#endif
#if LOSSD_PLUGIN_ABI_MINOR >= 5
  move(p.policy.vespo_k_pos, c.vespo_k_pos);
  move(p.policy.vespo_lambda_pos, c.vespo_lambda_pos);
  move(p.policy.vespo_k_neg, c.vespo_k_neg);
  move(p.policy.vespo_lambda_neg, c.vespo_lambda_neg);
#endif
}

template <typename O, typename C, typename Move>
void VisitOutputs(O& o, C& c, Move move) {
  move(o.grad_dtype, c.grad_dtype);
  move(o.loss, c.loss);
  move(o.z_loss, c.z_loss);
  move(o.lse, c.lse);
  move(o.predictions, c.predictions);
  move(o.accuracy, c.accuracy);
  move(o.tokens, c.tokens);
  move(o.dx, c.dx);
  move(o.dw, c.dw);
  move(o.db, c.db);
  move(o.dw_accum, c.dw_accum);
  move(o.db_accum, c.db_accum);
  move(o.accum_memory, c.accum_memory);
  move(o.logp, c.logp);
  move(o.entropy, c.entropy);
  move(o.kl, c.kl);
  move(o.clip_fraction, c.clip_fraction);
}

template <typename S, typename C, typename Move>
void VisitStats(S& s, C& c, Move move) {
  move(s.compute_seconds, c.compute_seconds);
  move(s.peak_extra_bytes, c.peak_extra_bytes);
  move(s.chunk_rows, c.chunk_rows);
  move(s.gemm_tunings, c.gemm_tunings);
  move(s.nonfinite, c.nonfinite);
}

template <typename P, typename C, typename Move>
void VisitOptimizerParams(P& p, C& c, Move move) {
  move(p.kind, c.kind);
  move(p.lr, c.lr);
  move(p.weight_decay, c.weight_decay);
  move(p.momentum, c.momentum);
  move(p.dampening, c.dampening);
  move(p.nesterov, c.nesterov);
  move(p.momentum_initialised, c.momentum_initialised);
  move(p.beta1, c.beta1);
  move(p.beta2, c.beta2);
  move(p.eps, c.eps);
  move(p.amsgrad, c.amsgrad);
  move(p.step, c.step);
  move(p.grad_scale, c.grad_scale);
}

template <typename T, typename C, typename Move>
void VisitOptimizerTensors(T& t, C& c, Move move) {
  move(t.n, c.n);
  move(t.param, c.param);
  move(t.grad, c.grad);
  move(t.state1, c.state1);
  move(t.state2, c.state2);
  move(t.state3, c.state3);
  move(t.copy, c.copy);
  move(t.copy_dtype, c.copy_dtype);
}

// The numbers only: the two strings are arrays on the C side (ToC and FromC copy them).
template <typename I, typename C, typename Move>
void VisitInfoNumbers(I& i, C& c, Move move) {
  move(i.memory_total_bytes, c.memory_total_bytes);
  move(i.memory_used_bytes, c.memory_used_bytes);
  move(i.memory_peak_bytes, c.memory_peak_bytes);
  move(i.memory_held_bytes, c.memory_held_bytes);
  move(i.memory_budget_bytes, c.memory_budget_bytes);
  move(i.healthy, c.healthy);
  move(i.loss_kinds, c.loss_kinds);
}

}  // namespace

int32_t WriteStatus(const absl::Status& s, LossdStatus* out) {
  const int32_t code = static_cast<int32_t>(s.code());
  if (out != nullptr) {
    out->code = code;
    if (!s.ok()) CopyCut(s.message(), out->message, out->message_capacity);
  }
  return code;
}

StatusBuffer::StatusBuffer() : status_{0, message_, sizeof(message_)} { message_[0] = '\0'; }

absl::Status StatusBuffer::ToStatus(int32_t code) const {
  if (code == 0) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(code), message_);
}

LossdWorkspaceShape ToC(const WorkspaceShape& s) {
  LossdWorkspaceShape c{};
  VisitWorkspaceShape(s, c, IntoC());
  return c;
}

WorkspaceShape FromC(const LossdWorkspaceShape& c) {
  WorkspaceShape s;
  VisitWorkspaceShape(s, c, OutOfC());
  return s;
}

LossdLossOptions ToC(const LossOptions& o) {
  LossdLossOptions c{};
  VisitOptions(o, c, IntoC());
  return c;
}

LossOptions FromC(const LossdLossOptions& c) {
  LossOptions o;
  VisitOptions(o, c, OutOfC());
  return o;
}

LossdProblem ToC(const LossProblem& p, const LossdRowStream* rows) {
  LossdProblem c{};
  VisitProblem(p, c, IntoC());
  c.options = ToC(p.options);
  VisitPolicy(p.policy, c.policy, IntoC());
  c.rows = rows;
  return c;
}

LossProblem FromC(const LossdProblem& c, RowStream* rows) {
  LossProblem p;
  VisitProblem(p, c, OutOfC());
  p.options = FromC(c.options);
  VisitPolicy(p.policy, c.policy, OutOfC());
  p.rows = rows;
  return p;
}

LossdOutputs ToC(const LossOutputs& o) {
  LossdOutputs c{};
  VisitOutputs(o, c, IntoC());
  return c;
}

LossOutputs FromC(const LossdOutputs& c) {
  LossOutputs o;
  VisitOutputs(o, c, OutOfC());
  return o;
}

LossdStats ToC(const LossStats& s) {
  LossdStats c{};
  VisitStats(s, c, IntoC());
  return c;
}

LossStats FromC(const LossdStats& c) {
  LossStats s;
  VisitStats(s, c, OutOfC());
  return s;
}

LossdOptimizerParams ToC(const OptimizerParams& p) {
  LossdOptimizerParams c{};
  VisitOptimizerParams(p, c, IntoC());
  return c;
}

OptimizerParams FromC(const LossdOptimizerParams& c) {
  OptimizerParams p;
  VisitOptimizerParams(p, c, OutOfC());
  return p;
}

LossdOptimizerTensors ToC(const OptimizerTensors& t) {
  LossdOptimizerTensors c{};
  VisitOptimizerTensors(t, c, IntoC());
  return c;
}

OptimizerTensors FromC(const LossdOptimizerTensors& c) {
  OptimizerTensors t;
  VisitOptimizerTensors(t, c, OutOfC());
  return t;
}

LossdBackendInfo ToC(const BackendInfo& i) {
  LossdBackendInfo c{};
  CopyCut(i.name, c.name, sizeof(c.name));
  CopyCut(i.device, c.device, sizeof(c.device));
#if LOSSD_PLUGIN_ABI_MINOR >= 1
  CopyCut(i.compute_path, c.compute_path, sizeof(c.compute_path));
#endif
  VisitInfoNumbers(i, c, IntoC());
  return c;
}

BackendInfo FromC(const LossdBackendInfo& c) {
  BackendInfo i;
  // The arrays are NUL-terminated by ToC; strnlen guards a plugin that did not.
  i.name.assign(c.name, strnlen(c.name, sizeof(c.name)));
  i.device.assign(c.device, strnlen(c.device, sizeof(c.device)));
#if LOSSD_PLUGIN_ABI_MINOR >= 1
  i.compute_path.assign(c.compute_path, strnlen(c.compute_path, sizeof(c.compute_path)));
#endif
  VisitInfoNumbers(i, c, OutOfC());
  return i;
}

}  // namespace lossd
