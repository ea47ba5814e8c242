// SPDX-License-Identifier: Apache-2.0
#include "kernels/cpu/policy_rows.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

#include "core/loss_problem.h"

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

// The policy surrogate of row i (ratio r, advantage a, its log-prob) and its derivative in
// logp, by loss type (policy_reference.h has the formulas). On a clamp bound r A gets half the
// gradient and delta's cap none, as torch's clamp and min give them.
double PolicySurrogate(const PolicyParams& o, double r, double a, double logp, bool* clipped,
                       double* dlogp) {
  if (o.loss_type == PolicyLossType::kGpg) {  // no ratio
    *clipped = false;
    *dlogp = -a;
    return -a * logp;
  }
  if (o.loss_type == PolicyLossType::kCispo) {  // the weight min(r, eps_high) is detached
    const double weight = std::min(r, static_cast<double>(o.epsilon_high));
    *clipped = r > static_cast<double>(o.epsilon_high) && a > 0;
    *dlogp = -weight * a;
    return -weight * a * logp;
  }
  if (o.loss_type == PolicyLossType::kSapo) {
    const double tau =
        static_cast<double>(a > 0 ? o.sapo_temperature_pos : o.sapo_temperature_neg);
    const double g = 1.0 / (1.0 + std::exp(-tau * (r - 1.0)));
    const double g_rest = 1.0 / (1.0 + std::exp(tau * (r - 1.0)));  // 1 - g, no cancellation
    *clipped = false;
    *dlogp = -4.0 * a * r * g * g_rest;
    return -a * 4.0 / tau * g;
  }
  const double lo = 1.0 - static_cast<double>(o.epsilon_low);
  const double hi = 1.0 + static_cast<double>(o.epsilon_high);
  const bool capped = o.delta != 0.0f && r >= static_cast<double>(o.delta);
  const double q = capped ? static_cast<double>(o.delta) : r;
  *clipped = (r < lo && a < 0) || (r > hi && a > 0);
  // delta > hi, so the cap only matters where min picks q A (A < 0).
  const bool none = *clipped || (capped && a < 0);
  const double share = none ? 0.0 : (r == lo || r == hi) ? 0.5 : 1.0;
  *dlogp = -share * a * r;
  return -std::min(q * a, std::clamp(r, lo, hi) * a);
}

// The KL estimator at d = logp - ref and the gradient its term passes to logp (k2's, d, when
// straight-through). low_var_kl is verl's k3: its clamps pass nothing where they hold.
double KlEstimate(const PolicyParams& o, double d, double* dk) {
  double k = 0;
  switch (o.kl_estimator) {
    case KlEstimator::kK3:
      k = std::exp(-d) + d - 1.0;
      *dk = 1.0 - std::exp(-d);
      break;
    case KlEstimator::kK1:
      k = d;
      *dk = 1.0;
      break;
    case KlEstimator::kK2:
      k = 0.5 * d * d;
      *dk = d;
      break;
    case KlEstimator::kAbs:
      k = std::abs(d);
      *dk = d > 0 ? 1.0 : d < 0 ? -1.0 : 0.0;
      break;
    case KlEstimator::kLowVarKl: {
      const double c = std::clamp(-d, -20.0, 20.0);
      const double k3 = std::exp(c) - c - 1.0;
      k = std::min(k3, 10.0);
      *dk = (std::abs(d) <= 20.0 && k3 <= 10.0) ? 1.0 - std::exp(c) : 0.0;
      break;
    }
  }
  if (o.kl_straight_through) *dk = d;
  return k;
}

}  // namespace

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
      case PolicyLossType::kGpg:
        w[i] = 1.0 / std::max(1.0, o.dapo_normalizer > 0 ? o.dapo_normalizer
                                                         : static_cast<double>(tokens));
        break;
    }
  }
  return w;
}

PolicyRowTerms PolicyTerms(const LossProblem& p, int64_t i, double logp, double entropy, double r,
                           bool sequence) {
  const PolicyParams& o = p.policy;
  const double a = p.advantages[i];
  PolicyRowTerms t;
  t.loss = PolicySurrogate(o, r, a, logp, &t.clipped, &t.dlogp);
  if (p.is_ratio != nullptr) {  // the rollout correction, on the policy term only
    t.loss *= p.is_ratio[i];
    t.dlogp *= p.is_ratio[i];
  }
  if (sequence) std::swap(t.dlogp, t.via_ratio);  // the clipped types' surrogate is all via r
  if (o.beta != 0.0f && p.ref_logp != nullptr) {
    double dkl = 0;
    const double k = KlEstimate(o, logp - p.ref_logp[i], &dkl);
    t.kl = k;
    if (o.use_bias_correction_kl) {  // K r, and (K r)' = K' r + K r', r' = r
      t.kl = k * r;
      if (sequence) {
        t.via_ratio += o.beta * k * r;
        dkl *= r;
      } else {
        dkl = dkl * r + k * r;
      }
    }
    t.loss += o.beta * t.kl;
    t.dlogp += o.beta * dkl;
  }
  if (o.entropy_coeff != 0.0f) {
    t.loss -= static_cast<double>(o.entropy_coeff) * entropy;
    t.dentropy = -static_cast<double>(o.entropy_coeff);
  }
  return t;
}

}  // namespace lossd
