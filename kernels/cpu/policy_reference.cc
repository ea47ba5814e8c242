// SPDX-License-Identifier: Apache-2.0
#include "kernels/cpu/policy_reference.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "core/dtype.h"
#include "kernels/cpu/logprob_reference.h"
#include "kernels/cpu/policy_reference_check.h"
#include "kernels/cpu/reference_head.h"

namespace lossd {
namespace {

bool Masked(const PolicyProblem& p, int64_t i) { return p.mask != nullptr && p.mask[i] == 0; }

// The row weights of an aggregation other than the loss type's (verl's loss_agg_mode), from
// the per-sequence mask counts and N; 0 where masked.
void AggregationWeights(const PolicyProblem& p, const std::vector<int64_t>& per_seq, int64_t n,
                        std::vector<double>* w) {
  const PolicyOptions& o = p.options;
  const int64_t bt = p.head.bt, seq = bt / p.batch;
  double g = 0;  // sequences with a counted token
  for (int64_t c : per_seq) g += c > 0 ? 1 : 0;
  if (o.dapo_normalizer > 0) g = o.dapo_normalizer;
  g = std::max(1.0, g);
  const double l = o.loss_scale_factor > 0 ? o.loss_scale_factor : static_cast<double>(seq);
  for (int64_t i = 0; i < bt; ++i) {
    if (Masked(p, i)) continue;
    switch (o.aggregation) {
      case PolicyAggregation::kLossType:  // not reached: RowWeights' own
      case PolicyAggregation::kTokenMean:
        (*w)[i] = 1.0 / std::max(1.0, o.dapo_normalizer > 0 ? o.dapo_normalizer
                                                            : static_cast<double>(n));
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

// Each row's weight in the loss (its normaliser, 0 where masked) and the mask count N.
// A copy of policy_rows.cc's PolicyWeights on purpose: the float64 oracle shares no code with
// the backend it checks.
std::vector<double> RowWeights(const PolicyProblem& p, int64_t* tokens,
                               std::vector<int64_t>* per_seq_out) {
  const PolicyOptions& o = p.options;
  const int64_t bt = p.head.bt, seq = bt / p.batch;
  const double b = static_cast<double>(p.batch);
  std::vector<int64_t>& per_seq = *per_seq_out;
  per_seq.assign(p.batch, 0);
  int64_t n = 0;
  for (int64_t i = 0; i < bt; ++i) {
    if (Masked(p, i)) continue;
    ++per_seq[i / seq];
    ++n;
  }
  *tokens = n;
  const double n_clamped = std::max(1.0, static_cast<double>(n));
  std::vector<double> w(bt, 0.0);
  if (o.aggregation != PolicyAggregation::kLossType) {
    AggregationWeights(p, per_seq, n, &w);
    return w;
  }
  for (int64_t i = 0; i < bt; ++i) {
    if (Masked(p, i)) continue;
    switch (o.loss_type) {
      case PolicyLossType::kGrpo:
      case PolicyLossType::kSapo:
      case PolicyLossType::kGeoMean:  // its KL and entropy terms; its policy term: GeoMeanTerm
        w[i] = 1.0 / (b * std::max(1.0, static_cast<double>(per_seq[i / seq])));
        break;
      case PolicyLossType::kLuspo:  // Liger divides by B times its (B, S) tensors' S
        w[i] = static_cast<double>(per_seq[i / seq]) / static_cast<double>(bt);
        break;
      case PolicyLossType::kBnpo:
        w[i] = 1.0 / n_clamped;
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
                                                         : static_cast<double>(n));
        break;
    }
  }
  return w;
}

// One row's loss terms and their derivative in logp_i, in two parts: `dlogp`, the part that
// does not pass through the ratio (cispo's detached weight times A, the KL term's own), and
// `dratio`, dl_i/dr times r (dr/dlogp = r): at token level both reach logp_i; at sequence
// level dratio reaches every token of the sequence through the mean of its log-ratios.
struct RowTerms {
  double ratio = 1, loss = 0, kl = 0, dlogp = 0, dratio = 0;
  double dentropy = 0;  // dl_i/dH_i: the entropy bonus's -entropy_coeff
  bool clipped = false;
};

// The KL estimator K at d = logp - ref and the gradient the term passes to logp (k2's, d,
// with the straight-through option).
void KlEstimate(const PolicyOptions& o, double d, double* k, double* dk) {
  switch (o.kl_estimator) {
    case KlEstimator::kK3:
      *k = std::exp(-d) + d - 1.0;
      *dk = 1.0 - std::exp(-d);
      break;
    case KlEstimator::kK1:
      *k = d;
      *dk = 1.0;
      break;
    case KlEstimator::kK2:
      *k = 0.5 * d * d;
      *dk = d;
      break;
    case KlEstimator::kAbs:
      *k = std::abs(d);
      *dk = d > 0 ? 1.0 : d < 0 ? -1.0 : 0.0;
      break;
    case KlEstimator::kLowVarKl: {  // verl clamps ref - logp = -d, then the value
      const double c = std::clamp(-d, -20.0, 20.0);
      const double k3 = std::exp(c) - c - 1.0;
      *k = std::min(k3, 10.0);
      *dk = (std::abs(d) <= 20.0 && k3 <= 10.0) ? 1.0 - std::exp(c) : 0.0;
      break;
    }
  }
  if (o.kl_straight_through) *dk = d;
}

// The surrogate pg_i and its dratio of the clipped types (dapo, grpo, bnpo, dr_grpo, luspo).
// On a bound, torch's clamp passes nothing and min's tie gives r A half the gradient; delta's
// cap passes nothing from r = delta on.
void ClippedSurrogate(const PolicyOptions& o, double a, RowTerms* r) {
  const double lo = 1.0 - static_cast<double>(o.epsilon_low);
  const double hi = 1.0 + static_cast<double>(o.epsilon_high);
  const double c = std::clamp(r->ratio, lo, hi);
  const bool capped = o.delta != 0.0f && r->ratio >= static_cast<double>(o.delta);
  const double q = capped ? static_cast<double>(o.delta) : r->ratio;
  r->loss = -std::min(q * a, c * a);
  r->clipped = (r->ratio < lo && a < 0) || (r->ratio > hi && a > 0);
  // q >= c (delta > hi), so the cap matters only where min picks q A: A < 0 and r > hi.
  double share = r->clipped ? 0.0 : (r->ratio == lo || r->ratio == hi) ? 0.5 : 1.0;
  if (capped && a < 0) share = 0.0;
  r->dratio = -share * a * r->ratio;
}

// What a row's group gives its terms: kl_cov's membership of P, vespo's weight phi_i.
struct GroupTerm {
  bool penalised = false;
  double phi = 0;
};

// Row i's terms at ratio `ratio` (its own, or its sequence's).
RowTerms PolicyRow(const PolicyProblem& p, int64_t i, double logp, double ratio,
                   double entropy, const GroupTerm& group) {
  const PolicyOptions& o = p.options;
  const double a = p.advantages[i];
  const bool penalised = group.penalised;
  RowTerms r;
  r.ratio = ratio;
  if (o.loss_type == PolicyLossType::kGeoMean) {
    // No per-token policy term: GeoMeanTerm adds the sequences'.
  } else if (o.loss_type == PolicyLossType::kVespo) {
    r.loss = -group.phi * a * logp;  // phi detached: a constant of the gradient
    r.dlogp = -group.phi * a;
  } else if (o.loss_type == PolicyLossType::kKlCov) {
    r.loss = -a * r.ratio;
    r.dratio = -a * r.ratio;
    if (penalised) {
      const double d = p.old_logp != nullptr ? logp - p.old_logp[i] : 0.0;
      const double c = o.ppo_kl_coef;
      r.loss += c * std::abs(d);
      r.dlogp += c * (d > 0 ? 1.0 : d < 0 ? -1.0 : 0.0);
      r.clipped = true;
    }
  } else if (o.loss_type == PolicyLossType::kGpg) {
    r.loss = -a * logp;
    r.dlogp = -a;
  } else if (o.loss_type == PolicyLossType::kCispo) {
    // The weight is detached: its value scales logp's gradient, nothing flows through it.
    const double bound = static_cast<double>(o.epsilon_high);
    const double weight = std::min(r.ratio, bound);
    r.loss = -weight * a * logp;
    r.dlogp = -weight * a;
    r.clipped = r.ratio > bound && a > 0;
  } else if (o.loss_type == PolicyLossType::kCispoClamp) {
    // As cispo, the weight detached; clamped to [1 - eps_low, 1 + eps_high] (verl's).
    const double lo = 1.0 - static_cast<double>(o.epsilon_low);
    const double hi = 1.0 + static_cast<double>(o.epsilon_high);
    const double weight = std::clamp(r.ratio, lo, hi);
    r.loss = -weight * a * logp;
    r.dlogp = -weight * a;
    r.clipped = r.ratio < lo || r.ratio > hi;
  } else if (o.loss_type == PolicyLossType::kSapo) {
    const double tau = static_cast<double>(a > 0 ? o.sapo_temperature_pos
                                                 : o.sapo_temperature_neg);
    const double x = tau * (r.ratio - 1.0);
    const double g = 1.0 / (1.0 + std::exp(-x));
    const double one_minus_g = 1.0 / (1.0 + std::exp(x));  // 1 - g without cancellation
    r.loss = -a * 4.0 / tau * g;
    r.dratio = -4.0 * a * r.ratio * g * one_minus_g;
  } else {
    ClippedSurrogate(o, a, &r);
  }
  // The rollout correction scales pg_i, before the KL term (vespo's is inside phi).
  if (p.is_ratio != nullptr && o.loss_type != PolicyLossType::kVespo) {
    const double rho = p.is_ratio[i];
    r.loss *= rho;
    r.dlogp *= rho;
    r.dratio *= rho;
  }
  if (o.beta != 0.0f && p.ref_logp != nullptr) {
    double k = 0, dk = 0;
    KlEstimate(o, logp - p.ref_logp[i], &k, &dk);
    r.kl = k;
    r.dlogp += o.beta * dk;
    if (o.use_bias_correction_kl) {  // (K r)' = K' r + K r'
      r.kl = k * r.ratio;
      r.dlogp += o.beta * dk * (r.ratio - 1.0);
      r.dratio += o.beta * k * r.ratio;
    }
    r.loss += o.beta * r.kl;
  }
  if (o.entropy_coeff != 0.0f) {
    r.loss -= static_cast<double>(o.entropy_coeff) * entropy;
    r.dentropy = -static_cast<double>(o.entropy_coeff);
  }
  return r;
}

// Each row's ratio: its own exp(logp_i - old_i) at token level; at sequence level its
// sequence's exp of the masked mean log-ratio. Without old log-probs every log-ratio is 0.
std::vector<double> Ratios(const PolicyProblem& p, const std::vector<double>& logp,
                           const std::vector<int64_t>& per_seq) {
  const int64_t bt = p.head.bt, seq = bt / p.batch;
  std::vector<double> log_ratio(bt, 0.0), ratio(bt, 1.0);
  for (int64_t i = 0; i < bt; ++i) {
    if (!Masked(p, i) && p.old_logp != nullptr) log_ratio[i] = logp[i] - p.old_logp[i];
  }
  if (p.options.importance_sampling == ImportanceSampling::kToken) {
    for (int64_t i = 0; i < bt; ++i) ratio[i] = std::exp(log_ratio[i]);
    return ratio;
  }
  for (int64_t b = 0; b < p.batch; ++b) {
    double sum = 0;
    for (int64_t i = b * seq; i < (b + 1) * seq; ++i) sum += log_ratio[i];
    const double r = std::exp(sum / std::max<double>(1.0, static_cast<double>(per_seq[b])));
    std::fill(ratio.begin() + b * seq, ratio.begin() + (b + 1) * seq, r);
  }
  return ratio;
}

// geo_mean's policy term (verl's GMPO), written from its formulas: per sequence with a
// counted row, R_b from the mean of the sign-clipped log-ratios, the mean advantage and the
// rollout correction's geometric mean; (1/B) pg_b added to the loss and (1/B) pg_b g_i / n_b to
// each row's dloss/dlogp (before grad_scale); the rows' ratio R_b; the clipped rows counted.
void GeoMeanTerm(const PolicyProblem& p, const std::vector<double>& logp,
                 const std::vector<int64_t>& per_seq, PolicyReferenceOutputs* out,
                 std::vector<double>* coef, int64_t* clipped) {
  const PolicyOptions& o = p.options;
  const int64_t seq = p.head.bt / p.batch;
  const double lo = o.epsilon_low, hi = o.epsilon_high, b = static_cast<double>(p.batch);
  std::vector<double> g(seq);
  for (int64_t s = 0; s < p.batch; ++s) {
    const double n = static_cast<double>(per_seq[s]);
    if (n == 0) continue;
    double sum_e = 0, sum_a = 0, sum_log_rho = 0;
    for (int64_t k = 0; k < seq; ++k) {
      const int64_t i = s * seq + k;
      g[k] = 0;
      if (Masked(p, i)) continue;
      const double a = p.advantages[i];
      const double d = p.old_logp != nullptr ? logp[i] - p.old_logp[i] : 0.0;
      const double c = std::clamp(d, -lo, hi);
      const double sign = a > 0 ? 1.0 : a < 0 ? -1.0 : 0.0;
      const bool clip = sign * d > sign * c;  // min picks the clamped value
      sum_e += sign * std::min(sign * d, sign * c);
      sum_a += a;
      if (p.is_ratio != nullptr) sum_log_rho += std::log(p.is_ratio[i] + 1e-10);
      g[k] = (sign == 0 || clip) ? 0.0 : 1.0;
      *clipped += clip ? 1 : 0;
    }
    const double ratio = std::exp(sum_e / n);
    const double rho = p.is_ratio != nullptr ? std::exp(sum_log_rho / n) : 1.0;
    const double pg = -(sum_a / n) * ratio * rho;
    out->loss += pg / b;
    for (int64_t k = 0; k < seq; ++k) {
      const int64_t i = s * seq + k;
      if (Masked(p, i)) continue;
      out->ratio[i] = ratio;
      (*coef)[i] += pg / b * g[k] / n;
    }
  }
}

// kl_cov's P: the k = max(1, floor(N ratio)) counted rows with the largest covariance
// (A_i - mean A)(logp_i - mean logp), ties to the lower row; empty without counted rows.
std::vector<bool> KlCovPenalised(const PolicyProblem& p, const std::vector<double>& logp) {
  const int64_t bt = p.head.bt;
  std::vector<bool> chosen(bt, false);
  std::vector<int64_t> rows;
  double mean_a = 0, mean_l = 0;
  for (int64_t i = 0; i < bt; ++i) {
    if (Masked(p, i)) continue;
    rows.push_back(i);
    mean_a += p.advantages[i];
    mean_l += logp[i];
  }
  if (rows.empty()) return chosen;
  const double n = static_cast<double>(rows.size());
  mean_a /= n;
  mean_l /= n;
  std::vector<double> cov(bt, 0.0);
  for (int64_t i : rows) cov[i] = (p.advantages[i] - mean_a) * (logp[i] - mean_l);
  const int64_t k = std::max<int64_t>(1, static_cast<int64_t>(n * p.options.kl_cov_ratio));
  std::stable_sort(rows.begin(), rows.end(),
                   [&](int64_t x, int64_t y) { return cov[x] > cov[y]; });
  for (int64_t j = 0; j < k && j < static_cast<int64_t>(rows.size()); ++j) chosen[rows[j]] = true;
  return chosen;
}

// vespo's weights (Liger's get_gamma_weights, written from its formula): per sequence b,
// u_b = sum_{i in b, m_i = 1} clamp(d_i, -20, 20) + sum_{i in b} clamp(log rho_i, log 1e-8, 20),
// log w_b = clamp(u_b, log 1e-8, 20); phi_i = exp(l_i + k_i log w_b - l_i w_b) with (k_i, l_i)
// the _pos pair where A_i >= 0, else the _neg one, l_i at least 1e-4; 0 if not finite.
std::vector<GroupTerm> VespoWeights(const PolicyProblem& p, const std::vector<double>& logp) {
  const PolicyOptions& o = p.options;
  const int64_t bt = p.head.bt, seq = bt / p.batch;
  std::vector<GroupTerm> group(bt);
  const double floor = std::log(1e-8);
  for (int64_t b = 0; b < p.batch; ++b) {
    double u = 0;
    for (int64_t i = b * seq; i < (b + 1) * seq; ++i) {
      if (p.is_ratio != nullptr) u += std::clamp(std::log(double{p.is_ratio[i]}), floor, 20.0);
      if (Masked(p, i) || p.old_logp == nullptr) continue;
      u += std::clamp(logp[i] - p.old_logp[i], -20.0, 20.0);
    }
    const double log_w = std::clamp(u, floor, 20.0), w = std::exp(log_w);
    for (int64_t i = b * seq; i < (b + 1) * seq; ++i) {
      const bool pos = p.advantages[i] >= 0;
      const double k = pos ? o.vespo_k_pos : o.vespo_k_neg;
      const double l = std::max(1e-4, double{pos ? o.vespo_lambda_pos : o.vespo_lambda_neg});
      const double phi = std::exp(l + k * log_w - l * w);
      group[i].phi = std::isfinite(phi) ? phi : 0.0;
    }
  }
  return group;
}

}  // namespace


absl::Status PolicyReference(const PolicyProblem& p, PolicyReferenceOutputs* out) {
  if (out == nullptr) return absl::InvalidArgumentError("policy reference: out must be non-null");
  if (absl::Status s = CheckPolicyProblem(p); !s.ok()) return s;
  const PolicyOptions& o = p.options;
  const int64_t bt = p.head.bt;
  const ReferenceHead head(p.head, o.softcap, o.temperature);
  *out = PolicyReferenceOutputs();
  out->logp.assign(bt, 0.0);
  out->ratio.assign(bt, 0.0);
  out->dl_dlogp.assign(bt, 0.0);
  out->kl_token.assign(bt, 0.0);
  out->grad = head.ZeroGradients();
  std::vector<int64_t> per_seq;
  const std::vector<double> weight = RowWeights(p, &out->tokens, &per_seq);

  // First every row's logp (a sequence's ratio needs all of them), then the terms, then the
  // gradients: dloss/dlogp_j = w_j dlogp_j + (token level) w_j dratio_j, or (sequence level)
  // m_j / max(1, n_b) sum_{i in b} w_i dratio_i.
  HeadRow row;
  std::vector<double> prob, g, entropy(bt, 0.0);
  for (int64_t i = 0; i < bt; ++i) {
    if (Masked(p, i)) continue;
    head.Row(i, &row);
    out->logp[i] = RowLogprob(row, LoadAsInt(p.targets, p.target_dtype, i));
    if (o.entropy_coeff != 0.0f) {
      Softmax(row, &prob);
      entropy[i] = RowEntropy(row, prob);
    }
  }
  const std::vector<double> ratio = Ratios(p, out->logp, per_seq);
  std::vector<GroupTerm> group(bt);
  if (o.loss_type == PolicyLossType::kKlCov) {
    const std::vector<bool> penalised = KlCovPenalised(p, out->logp);
    for (int64_t i = 0; i < bt; ++i) group[i].penalised = penalised[i];
  } else if (o.loss_type == PolicyLossType::kVespo) {
    group = VespoWeights(p, out->logp);
  }
  const bool sequence = o.importance_sampling == ImportanceSampling::kSequence;
  const int64_t seq = bt / p.batch;
  std::vector<double> coef(bt, 0.0), seq_dratio(p.batch, 0.0), dentropy(bt, 0.0);
  double kl_sum = 0;
  int64_t clipped = 0;
  for (int64_t i = 0; i < bt; ++i) {
    if (Masked(p, i)) continue;
    const RowTerms r = PolicyRow(p, i, out->logp[i], ratio[i], entropy[i], group[i]);
    out->ratio[i] = r.ratio;
    out->loss += weight[i] * r.loss;
    out->kl_token[i] = r.kl;
    dentropy[i] = weight[i] * r.dentropy;
    kl_sum += r.kl;
    clipped += r.clipped ? 1 : 0;
    coef[i] = weight[i] * (r.dlogp + (sequence ? 0.0 : r.dratio));
    if (sequence) seq_dratio[i / seq] += weight[i] * r.dratio;
  }
  if (o.loss_type == PolicyLossType::kGeoMean) {
    GeoMeanTerm(p, out->logp, per_seq, out, &coef, &clipped);
  }
  for (int64_t i = 0; i < bt; ++i) {
    if (Masked(p, i)) continue;
    if (sequence) coef[i] += seq_dratio[i / seq] / std::max<double>(1.0, per_seq[i / seq]);
    out->dl_dlogp[i] = coef[i] / weight[i];
    const double dlogp = static_cast<double>(o.grad_scale) * coef[i];
    const double dh = static_cast<double>(o.grad_scale) * dentropy[i];
    if (dlogp == 0 && dh == 0) continue;
    head.Row(i, &row);
    Softmax(row, &prob);
    LogprobLogitGradient(row, prob, LoadAsInt(p.targets, p.target_dtype, i), dlogp, dh, &g);
    head.AddGradients(row, g, &out->grad);
  }
  const double n = std::max(1.0, static_cast<double>(out->tokens));
  out->has_kl = o.beta != 0.0f;
  out->kl = out->has_kl ? kl_sum / n : 0.0;
  out->clip_fraction = static_cast<double>(clipped) / n;
  return absl::OkStatus();
}

}  // namespace lossd
