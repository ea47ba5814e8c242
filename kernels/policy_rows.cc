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
              pm::kGpg == static_cast<int32_t>(PolicyLossType::kGpg) && kPolicyLossTypes == 8);
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
  const bool has_ref = p.ref_logp != nullptr;
  return policy_math::Terms(PolicyRowOptionsOf(p.policy), logp, entropy, r, p.advantages[i],
                            p.is_ratio != nullptr ? p.is_ratio[i] : 1.0, has_ref,
                            has_ref ? p.ref_logp[i] : 0.0, sequence);
}

}  // namespace lossd
