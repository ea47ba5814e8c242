// SPDX-License-Identifier: Apache-2.0
#include "kernels/policy_rows.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "core/loss_problem.h"
#include "kernels/policy_math.h"

namespace lossd {
namespace {

// verl's loss_agg_mode as row weights: G the sequences with a counted row (or the normaliser
// given), L the loss_scale_factor (or S).
void AggregationWeights(const LossProblem& p, const std::vector<uint8_t>& counted,
                        const std::vector<int64_t>& per_seq, int64_t tokens,
                        std::vector<double>* w) {
  const PolicyParams& o = p.policy;
  const int64_t seq = p.bt / o.sequences;
  double g = 0;
  for (int64_t c : per_seq) g += c > 0 ? 1 : 0;
  g = std::max(1.0, o.dapo_normalizer > 0 ? o.dapo_normalizer : g);
  const double d = std::max(1.0, o.dapo_normalizer > 0 ? o.dapo_normalizer
                                                       : static_cast<double>(tokens));
  const double l = o.loss_scale_factor > 0 ? o.loss_scale_factor : static_cast<double>(seq);
  for (int64_t i = 0; i < p.bt; ++i) {
    if (!counted[i]) continue;
    switch (o.aggregation) {
      case PolicyAggregation::kLossType:  // PolicyWeights' own; not reached
      case PolicyAggregation::kTokenMean:
        (*w)[i] = 1.0 / d;
        break;
      case PolicyAggregation::kSeqMeanTokenSum:
        (*w)[i] = 1.0 / g;
        break;
      case PolicyAggregation::kSeqMeanTokenMean:  // a counted row's n_b >= 1
        (*w)[i] = 1.0 / (g * static_cast<double>(per_seq[i / seq]));
        break;
      case PolicyAggregation::kSeqMeanTokenSumNorm:
        (*w)[i] = 1.0 / (g * l);
        break;
    }
  }
}

// policy_math reads core's enums by value.
namespace pm = policy_math;
static_assert(pm::kDapo == static_cast<int32_t>(PolicyLossType::kDapo) &&
              pm::kGrpo == static_cast<int32_t>(PolicyLossType::kGrpo) &&
              pm::kBnpo == static_cast<int32_t>(PolicyLossType::kBnpo) &&
              pm::kDrGrpo == static_cast<int32_t>(PolicyLossType::kDrGrpo) &&
              pm::kCispo == static_cast<int32_t>(PolicyLossType::kCispo) &&
              pm::kSapo == static_cast<int32_t>(PolicyLossType::kSapo) &&
              pm::kLuspo == static_cast<int32_t>(PolicyLossType::kLuspo) &&
              pm::kGpg == static_cast<int32_t>(PolicyLossType::kGpg) &&
              pm::kGeoMean == static_cast<int32_t>(PolicyLossType::kGeoMean) &&
              pm::kKlCov == static_cast<int32_t>(PolicyLossType::kKlCov) &&
              pm::kVespo == static_cast<int32_t>(PolicyLossType::kVespo) &&
              pm::kCispoClamp == static_cast<int32_t>(PolicyLossType::kCispoClamp) &&
              kPolicyLossTypes == 12);
static_assert(pm::kK3 == static_cast<int32_t>(KlEstimator::kK3) &&
              pm::kK1 == static_cast<int32_t>(KlEstimator::kK1) &&
              pm::kK2 == static_cast<int32_t>(KlEstimator::kK2) &&
              pm::kAbs == static_cast<int32_t>(KlEstimator::kAbs) &&
              pm::kLowVarKl == static_cast<int32_t>(KlEstimator::kLowVarKl) && kKlEstimators == 5);

}  // namespace

policy_math::RowOptions PolicyRowOptionsOf(const PolicyParams& o) {
  policy_math::RowOptions r;
  r.loss_type = static_cast<int32_t>(o.loss_type);
  r.epsilon_low = o.epsilon_low;
  r.epsilon_high = o.epsilon_high;
  r.beta = o.beta;
  r.sapo_temperature_pos = o.sapo_temperature_pos;
  r.sapo_temperature_neg = o.sapo_temperature_neg;
  r.delta = o.delta;
  r.use_bias_correction_kl = o.use_bias_correction_kl ? 1 : 0;
  r.kl_estimator = static_cast<int32_t>(o.kl_estimator);
  r.kl_straight_through = o.kl_straight_through ? 1 : 0;
  r.entropy_coeff = o.entropy_coeff;
  return r;
}

std::vector<double> PolicyWeights(const LossProblem& p, const std::vector<uint8_t>& counted,
                                  int64_t tokens) {
  const PolicyParams& o = p.policy;
  const int64_t bt = p.bt, seq = bt / o.sequences;
  const double b = static_cast<double>(o.sequences);
  std::vector<int64_t> per_seq(o.sequences, 0);
  for (int64_t i = 0; i < bt; ++i) per_seq[i / seq] += counted[i];
  std::vector<double> w(bt, 0.0);
  if (o.aggregation != PolicyAggregation::kLossType) {
    AggregationWeights(p, counted, per_seq, tokens, &w);
    return w;
  }
  for (int64_t i = 0; i < bt; ++i) {
    if (!counted[i]) continue;
    switch (o.loss_type) {
      case PolicyLossType::kGrpo:
      case PolicyLossType::kSapo:
      case PolicyLossType::kGeoMean:  // its KL and entropy terms (PolicySequenceRows)
        w[i] = 1.0 / (b * std::max(1.0, static_cast<double>(per_seq[i / seq])));
        break;
      case PolicyLossType::kLuspo:
        w[i] = static_cast<double>(per_seq[i / seq]) / static_cast<double>(bt);
        break;
      case PolicyLossType::kBnpo:
        w[i] = 1.0 / std::max(1.0, static_cast<double>(tokens));
        break;
      case PolicyLossType::kDrGrpo:
        w[i] = 1.0 / (b * static_cast<double>(o.max_completion_length));
        break;
      case PolicyLossType::kDapo:
      case PolicyLossType::kCispo:
      case PolicyLossType::kCispoClamp:
      case PolicyLossType::kGpg:
      case PolicyLossType::kKlCov:
      case PolicyLossType::kVespo:
        w[i] = 1.0 / std::max(1.0, o.dapo_normalizer > 0 ? o.dapo_normalizer
                                                         : static_cast<double>(tokens));
        break;
    }
  }
  return w;
}

PolicyRowTerms PolicyTerms(const LossProblem& p, int64_t i, double logp, double entropy, double r,
                           bool sequence) {
  const bool has_ref = p.ref_logp != nullptr;
  return policy_math::Terms(PolicyRowOptionsOf(p.policy), logp, entropy, r, p.advantages[i],
                            p.is_ratio != nullptr ? p.is_ratio[i] : 1.0, has_ref,
                            has_ref ? p.ref_logp[i] : 0.0, sequence);
}

namespace {

// kl_cov over the whole call: each counted row's own ratio and terms, the penalty
// ppo_kl_coef |d| (times rho) on the k rows of largest covariance (policy_reference.h's P).
void KlCovRows(const LossProblem& p, const uint8_t* counted, const double* weight,
               const double* logp, const double* entropy, PolicySequenceRow* rows) {
  const PolicyParams& po = p.policy;
  const policy_math::RowOptions o = PolicyRowOptionsOf(po);
  std::vector<int64_t> order;
  double mean_a = 0, mean_l = 0;
  for (int64_t i = 0; i < p.bt; ++i) {
    rows[i] = PolicySequenceRow();
    if (!counted[i]) continue;
    order.push_back(i);
    mean_a += p.advantages[i];
    mean_l += logp[i];
  }
  if (order.empty()) return;
  const double n = static_cast<double>(order.size());
  mean_a /= n;
  mean_l /= n;
  std::vector<double> cov(p.bt, 0.0);
  for (int64_t i : order) cov[i] = (p.advantages[i] - mean_a) * (logp[i] - mean_l);
  const size_t k = std::max<size_t>(1, static_cast<size_t>(n * po.kl_cov_ratio));
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t x, int64_t y) { return cov[x] > cov[y]; });
  std::vector<uint8_t> chosen(p.bt, 0);
  for (size_t j = 0; j < k && j < order.size(); ++j) chosen[order[j]] = 1;
  const bool has_ref = p.ref_logp != nullptr;
  for (int64_t i = 0; i < p.bt; ++i) {
    if (!counted[i]) continue;
    PolicySequenceRow& r = rows[i];
    const double d = p.old_logp != nullptr ? logp[i] - static_cast<double>(p.old_logp[i]) : 0.0;
    const double rho = p.is_ratio != nullptr ? p.is_ratio[i] : 1.0;
    r.ratio = std::exp(d);
    r.terms = policy_math::Terms(o, logp[i], po.entropy_coeff != 0.0f ? entropy[i] : 0.0,
                                 r.ratio, p.advantages[i], rho, has_ref,
                                 has_ref ? static_cast<double>(p.ref_logp[i]) : 0.0, false);
    if (chosen[i]) {
      const double c = rho * static_cast<double>(po.ppo_kl_coef);
      r.terms.loss += c * std::fabs(d);
      r.terms.dlogp += c * (d > 0 ? 1.0 : d < 0 ? -1.0 : 0.0);
      r.terms.clipped = true;
    }
    r.loss = weight[i] * r.terms.loss;
    r.coef = weight[i] * r.terms.dlogp;
  }
}

// vespo over one sequence [b0, b0 + S): u the sum of its counted rows' log-ratios (each
// clamped to [-20, 20]) and, with is_ratio, of every row's log rho (clamped to [log 1e-8, 20],
// counted or not, as Liger sums its vllm_is_ratio unmasked); each counted row's policy term
// -phi A logp with phi = VespoWeight(u) at its advantage's (k, lambda), a constant of the
// gradient; its KL and entropy terms at its own ratio.
void VespoRows(const LossProblem& p, const uint8_t* counted, const double* weight,
               const double* logp, const double* entropy, int64_t b0, PolicySequenceRow* rows) {
  const PolicyParams& po = p.policy;
  const policy_math::RowOptions o = PolicyRowOptionsOf(po);
  const int64_t s = p.bt / po.sequences;
  auto log_ratio = [&](int64_t i) {
    return p.old_logp != nullptr ? logp[i] - static_cast<double>(p.old_logp[i]) : 0.0;
  };
  double u = 0;
  for (int64_t k = 0; k < s; ++k) {
    const int64_t i = b0 + k;
    rows[k] = PolicySequenceRow();
    if (p.is_ratio != nullptr) {
      u += std::clamp(std::log(static_cast<double>(p.is_ratio[i])), std::log(1e-8), 20.0);
    }
    if (counted[i]) u += std::clamp(log_ratio(i), -20.0, 20.0);
  }
  const bool has_ref = p.ref_logp != nullptr;
  // The sequence's two weights, by the advantage's sign.
  const double phi_pos = policy_math::VespoWeight(u, po.vespo_k_pos, po.vespo_lambda_pos);
  const double phi_neg = policy_math::VespoWeight(u, po.vespo_k_neg, po.vespo_lambda_neg);
  for (int64_t k = 0; k < s; ++k) {
    const int64_t i = b0 + k;
    if (!counted[i]) continue;
    PolicySequenceRow& r = rows[k];
    const double a = p.advantages[i];
    const double phi = a >= 0 ? phi_pos : phi_neg;
    r.ratio = std::exp(log_ratio(i));
    r.terms = policy_math::Terms(o, logp[i], po.entropy_coeff != 0.0f ? entropy[i] : 0.0,
                                 r.ratio, a, 1.0, has_ref,
                                 has_ref ? static_cast<double>(p.ref_logp[i]) : 0.0, false);
    r.terms.loss -= phi * a * logp[i];
    r.terms.dlogp -= phi * a;
    r.loss = weight[i] * r.terms.loss;
    r.coef = weight[i] * r.terms.dlogp;
  }
}

}  // namespace

void PolicySequenceRows(const LossProblem& p, const uint8_t* counted, const double* weight,
                        const double* logp, const double* entropy, int64_t b0,
                        PolicySequenceRow* rows) {
  const PolicyParams& po = p.policy;
  if (po.loss_type == PolicyLossType::kKlCov) {
    KlCovRows(p, counted, weight, logp, entropy, rows);
    return;
  }
  if (po.loss_type == PolicyLossType::kVespo) {
    VespoRows(p, counted, weight, logp, entropy, b0, rows);
    return;
  }
  const policy_math::RowOptions o = PolicyRowOptionsOf(po);
  const int64_t s = p.bt / po.sequences;
  const bool geo = po.loss_type == PolicyLossType::kGeoMean;
  const bool has_ref = p.ref_logp != nullptr;
  const bool has_entropy = po.entropy_coeff != 0.0f;
  // The sequence's sums: log-ratios (geo_mean's clipped), advantages, log rho.
  double sum = 0, sum_a = 0, sum_log_rho = 0;
  int64_t n = 0;
  // geo_mean: each row's slope g_i of its clipped log-ratio, and whether the clip held.
  std::vector<double> slope(geo ? s : 0, 0.0);
  std::vector<uint8_t> clipped(geo ? s : 0, 0);
  for (int64_t k = 0; k < s; ++k) {
    const int64_t i = b0 + k;
    rows[k] = PolicySequenceRow();
    if (!counted[i]) continue;
    const double d = p.old_logp != nullptr ? logp[i] - static_cast<double>(p.old_logp[i]) : 0.0;
    if (geo) {
      bool clip = false;
      sum += policy_math::GeoMeanLogRatio(o, d, p.advantages[i], &clip, &slope[k]);
      clipped[k] = clip ? 1 : 0;
      sum_a += p.advantages[i];
      if (p.is_ratio != nullptr) sum_log_rho += std::log(static_cast<double>(p.is_ratio[i]) + 1e-10);
    } else {
      sum += d;
    }
    ++n;
  }
  const double nb = std::max(1.0, static_cast<double>(n));
  const double ratio = std::exp(sum / nb);
  double via = 0;  // GSPO: sum_{j in b} w_j e_j
  // geo_mean's (1/B) pg_b, pg_b = -mean(A)_b R_b rho_b (verl's geometric mean of rho).
  const double pg_b = geo ? -(sum_a / nb) * ratio *
                                (p.is_ratio != nullptr ? std::exp(sum_log_rho / nb) : 1.0) /
                                static_cast<double>(po.sequences)
                          : 0.0;
  for (int64_t k = 0; k < s; ++k) {
    const int64_t i = b0 + k;
    if (!counted[i]) continue;
    PolicySequenceRow& r = rows[k];
    const double h = has_entropy ? entropy[i] : 0.0;
    const double ref = has_ref ? static_cast<double>(p.ref_logp[i]) : 0.0;
    r.ratio = ratio;
    if (geo) {  // its KL and entropy terms per token; its policy term the sequence's
      r.terms = policy_math::Terms(o, logp[i], h, ratio, p.advantages[i], 1.0, has_ref, ref,
                                   false);
      r.terms.clipped = clipped[k] != 0;
      r.loss = weight[i] * r.terms.loss + pg_b / nb;
      r.coef = weight[i] * r.terms.dlogp + pg_b * slope[k] / nb;
      continue;
    }
    r.terms = policy_math::Terms(o, logp[i], h, ratio, p.advantages[i],
                                 p.is_ratio != nullptr ? p.is_ratio[i] : 1.0, has_ref, ref, true);
    r.loss = weight[i] * r.terms.loss;
    r.coef = weight[i] * r.terms.dlogp;
    via += weight[i] * r.terms.via_ratio;
  }
  if (geo) return;
  for (int64_t k = 0; k < s; ++k) {
    if (counted[b0 + k]) rows[k].coef += via / nb;
  }
}

}  // namespace lossd
