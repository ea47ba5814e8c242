// SPDX-License-Identifier: Apache-2.0
// The error bounds of the GPU tests of the logprob, policy and distill kinds
// (row_loss_test_cases.h says the model): each kind's expected results from its float64
// reference, with the first-order bounds of what the stored logits' rounding, G's storage, the
// gradient dtype and fp32 arithmetic can change. Test-only.
#ifndef LOSSD_TESTING_CUDA_ROW_LOSS_TEST_BOUNDS_H_
#define LOSSD_TESTING_CUDA_ROW_LOSS_TEST_BOUNDS_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "core/loss_problem.h"
#include "gtest/gtest.h"
#include "kernels/cpu/distill_reference.h"
#include "kernels/cpu/logprob_reference.h"
#include "kernels/cpu/policy_reference.h"
#include "kernels/cpu/reference_head.h"
#include "testing/cpu/policy_test_util.h"
#include "testing/test_util.h"

namespace lossd {
namespace cuda {

inline constexpr double kMargin = 2.0;

// |log r - log bound| > this for every row, so that logp's error never flips a clip.
inline constexpr double kClipMargin = 0.15;

// The reference's results in one form for every kind.
struct Expected {
  std::vector<double> logp, entropy, logp_bound, entropy_bound;
  double loss = 0, loss_bound = 0, kl = 0, kl_bound = 0, clip_fraction = 0;
  HeadGradients grad;
  double grad_tol = 0;
};

// Each row's gradient coefficients (row_loss_kernels.h: G_j = c ([j = t] - p_j) -
// e p_j (log p_j + H)) and the bound of c's error per unit of logp's error (policy's c
// depends on logp; 0 for logprob).
struct RowCoefficients {
  std::vector<double> c, e, c_slope;  // (BT), 0 on ignored rows
};

// First-order bounds of what the stored logits' rounding changes (relative u of each raw
// logit, as the cross-entropy tests' ComputeErrorBounds). Per row that counts, with
// d_j = u |raw_j| dz_j/du_j bounding |dz_j| and D = sum_k p_k d_k:
//   |d logp| <= d_t + D,   |dH| <= sum_k p_k |log p_k + H| (d_k + D),   |dp_j| <= p_j (d_j + D);
// and ||dG|| / ||G|| over the batch from each element's bound (c's own error c_slope |d logp|
// included), times the softcap's slope, plus G's storage rounding u |G_j|.
struct HeadBounds {
  std::vector<double> logp, entropy;  // (BT); 0 on ignored rows
  double grad_rel = 0;
};

inline HeadBounds FirstOrderBounds(const LossProblem& p, const RowCoefficients& k, double u) {
  const ReferenceHead head(HeadInputs{p.bt, p.h, p.v, p.dtype, p.x, p.w, p.bias},
                           p.options.softcap, p.options.temperature);
  const double temp = p.options.temperature, cap = p.options.softcap;
  HeadBounds out;
  out.logp.assign(p.bt, 0.0);
  out.entropy.assign(p.bt, 0.0);
  HeadRow row;
  std::vector<double> prob, d(p.v);
  double err2 = 0, norm2 = 0;
  for (int64_t i = 0; i < p.bt; ++i) {
    const int64_t t = LoadAsInt(p.targets, p.target_dtype, i);
    if (t == p.options.ignore_index) continue;
    head.Row(i, &row);
    Softmax(row, &prob);
    double pz = 0, big_d = 0;
    for (int64_t j = 0; j < p.v; ++j) {
      const double zc = row.z[j] * temp;  // the softcapped logit: raw through atanh
      const double raw = cap > 0 ? cap * std::atanh(std::min(0.999999999, std::fabs(zc) / cap))
                                 : std::fabs(zc);
      d[j] = u * raw * row.dz_du[j];
      big_d += prob[j] * d[j];
      pz += prob[j] * row.z[j];
    }
    const double h = row.lse - pz;
    double dh = 0;
    for (int64_t j = 0; j < p.v; ++j) {
      dh += prob[j] * std::fabs(row.z[j] - row.lse + h) * (d[j] + big_d);
    }
    const double dlogp = d[t] + big_d;
    out.logp[i] = dlogp;
    out.entropy[i] = dh;
    if (k.c[i] == 0 && k.e[i] == 0) continue;
    for (int64_t j = 0; j < p.v; ++j) {
      const double pj = prob[j], lp = row.z[j] - row.lse, hot = j == t ? 1.0 : 0.0;
      const double g = k.c[i] * (hot - pj) - k.e[i] * pj * (lp + h);
      const double dpj = pj * (d[j] + big_d);
      double dg = std::fabs(k.c[i]) * dpj + k.c_slope[i] * dlogp * std::fabs(hot - pj) +
                  std::fabs(k.e[i]) * (dpj * (std::fabs(lp + h) + 1) + pj * dh);
      dg += u * std::fabs(g);
      const double chain = row.dz_du[j] * temp;  // the softcap's slope (the 1/T is common)
      err2 += dg * dg * chain * chain;
      norm2 += g * g * chain * chain;
    }
  }
  out.grad_rel = norm2 > 0 ? std::sqrt(err2 / norm2) : 0.0;
  std::printf("    G's first-order relative error bound %.2e\n", out.grad_rel);
  return out;
}

// The per-row bounds of logp and entropy: the first-order ones with a margin, and fp32
// arithmetic.
inline void RowBounds(const HeadBounds& b, const Tolerance& tol, Expected* e) {
  for (size_t i = 0; i < b.logp.size(); ++i) {
    const double h = e->entropy.empty() ? 0.0 : e->entropy[i];
    e->logp_bound.push_back(kMargin * b.logp[i] + tol.fp32_rel * (std::fabs(e->logp[i]) + 1));
    e->entropy_bound.push_back(kMargin * b.entropy[i] + tol.fp32_rel * (h + 1));
  }
}

// The gradients' relative-norm tolerance, as the cross-entropy tests': twice the bound on G's
// relative error (the GEMMs with random X and W carry it over about unchanged), the gradient
// dtype's rounding, fp32 arithmetic, and the GEMMs' own fp32 rounding.
inline double GradTolerance(const LossProblem& p, const Tolerance& tol, double grad_rel) {
  return kMargin * grad_rel + tol.grad_u + tol.fp32_rel +
         4 * std::sqrt(static_cast<double>(std::max(p.v, p.bt))) * std::ldexp(1.0, -24);
}

// A scalar's bound from its rows' (independent) first-order errors: 4 times their root sum of
// squares, as the cross-entropy tests' scalar losses, plus fp32 arithmetic.
inline double ScalarBound(const std::vector<double>& row_errors, double value,
                          const Tolerance& tol) {
  double sq = 0;
  for (double x : row_errors) sq += x * x;
  return 4 * std::sqrt(sq) + tol.fp32_rel * (std::fabs(value) + 1);
}

inline Expected ExpectLogprob(const LossProblem& p, const Tolerance& tol) {
  LogprobProblem lp;
  lp.head = HeadInputs{p.bt, p.h, p.v, p.dtype, p.x, p.w, p.bias};
  lp.targets = p.targets;
  lp.target_dtype = p.target_dtype;
  lp.dlogp = p.dlogp;
  lp.dentropy = p.dentropy;
  lp.options.temperature = p.options.temperature;
  lp.options.softcap = p.options.softcap;
  lp.options.ignore_index = p.options.ignore_index;
  LogprobReferenceOutputs ref;
  EXPECT_TRUE(LogprobReference(lp, &ref).ok());
  Expected e;
  e.logp = ref.logp;
  e.entropy = ref.entropy;
  const double gs = p.options.grad_scale;
  RowCoefficients k;
  for (int64_t i = 0; i < p.bt; ++i) {
    const bool counts = LoadAsInt(p.targets, p.target_dtype, i) != p.options.ignore_index;
    k.c.push_back(counts && p.dlogp != nullptr ? gs * p.dlogp[i] : 0.0);
    k.e.push_back(counts && p.dentropy != nullptr ? gs * p.dentropy[i] : 0.0);
    k.c_slope.push_back(0.0);
  }
  const HeadBounds b = FirstOrderBounds(p, k, tol.logit_u);
  RowBounds(b, tol, &e);
  std::vector<double> row_errors;
  for (int64_t i = 0; i < p.bt; ++i) {
    e.loss += k.c[i] * ref.logp[i] + k.e[i] * ref.entropy[i];
    row_errors.push_back(std::fabs(k.c[i]) * b.logp[i] + std::fabs(k.e[i]) * b.entropy[i]);
  }
  e.loss_bound = ScalarBound(row_errors, e.loss, tol);
  e.grad_tol = GradTolerance(p, tol, b.grad_rel);
  // The reference scales its gradients by nothing: F's gradient is grad_scale times it.
  e.grad = ref.grad;
  for (std::vector<double>* g : {&e.grad.dx, &e.grad.dw, &e.grad.db}) {
    for (double& x : *g) x *= gs;
  }
  return e;
}

// Policy's row weights w_i (policy_reference.h's normalisers, or verl's aggregation; 0 where
// masked).
inline std::vector<double> PolicyWeights(const PolicyProblem& pp, const std::vector<uint8_t>& mask,
                                         double n) {
  const PolicyOptions& o = pp.options;
  const int64_t bt = static_cast<int64_t>(mask.size()), seq = bt / pp.batch;
  const double b = static_cast<double>(pp.batch);
  std::vector<double> per_seq(pp.batch, 0.0), w(bt, 0.0);
  for (int64_t i = 0; i < bt; ++i) per_seq[i / seq] += mask[i];
  double g = 0;
  for (double c : per_seq) g += c > 0 ? 1.0 : 0.0;
  g = std::max(1.0, o.dapo_normalizer > 0 ? o.dapo_normalizer : g);
  const double l = o.loss_scale_factor > 0 ? o.loss_scale_factor : static_cast<double>(seq);
  for (int64_t i = 0; i < bt; ++i) {
    if (!mask[i]) continue;
    switch (o.aggregation) {
      case PolicyAggregation::kLossType:
        break;
      case PolicyAggregation::kTokenMean:
        w[i] = 1.0 / std::max(1.0, o.dapo_normalizer > 0 ? o.dapo_normalizer : n);
        continue;
      case PolicyAggregation::kSeqMeanTokenSum:
        w[i] = 1.0 / g;
        continue;
      case PolicyAggregation::kSeqMeanTokenMean:
        w[i] = 1.0 / (g * per_seq[i / seq]);
        continue;
      case PolicyAggregation::kSeqMeanTokenSumNorm:
        w[i] = 1.0 / (g * l);
        continue;
    }
    const PolicyLossType t = o.loss_type;
    w[i] = 1.0 / n;  // bnpo
    if (t == PolicyLossType::kGrpo || t == PolicyLossType::kSapo ||
        t == PolicyLossType::kGeoMean) {
      w[i] = 1.0 / (b * std::max(1.0, per_seq[i / seq]));
    }
    if (t == PolicyLossType::kLuspo) w[i] = per_seq[i / seq] / static_cast<double>(bt);
    if (t == PolicyLossType::kDrGrpo) w[i] = 1.0 / (b * o.max_completion_length);
    if (t == PolicyLossType::kDapo || t == PolicyLossType::kCispo || t == PolicyLossType::kGpg ||
        t == PolicyLossType::kKlCov || t == PolicyLossType::kVespo) {
      w[i] = 1.0 / std::max(1.0, o.dapo_normalizer > 0 ? o.dapo_normalizer : n);
    }
  }
  return w;
}

// Policy at sequence level (policy_reference.h): c_j = gs (w_j f_j + (1 / max(1, n_b))
// sum_{i in b} w_i e_i) depends on every logp of sequence b through log R_b, the mean of its
// counted rows' log-ratios, whose error is at most their bounds' mean dbar_b (0 without old
// log-probs: R_b is then 1 whatever logp is). First order, with d_j row j's own bound:
//   |dc_j| / |gs| <= w_j (|df_j/dlogp_j| d_j + |df_j/dlog R| dbar_b)
//                  + (1 / max(1, n_b)) sum_{i in b} w_i (|de_i/dlog R| dbar_b + |de_i/dlogp_i| d_i)
// handed to FirstOrderBounds as the slope |dc_j| / d_j. The loss (and the kl metric) move with
// logp_k directly and through log R_b, a mean: as a sum over independent rows k (ScalarBound's
// model), row k's entry is (E_b / max(1, n_b) + w_k |dl_k/dlogp_k|) d_k, where E_b =
// sum_{i in b} w_i |dl_i/dlog R| (0 without old log-probs).
struct SequenceErrors {
  std::vector<double> c_slope, loss, kl;
};

inline SequenceErrors PolicySequenceErrors(const LossProblem& p, const PolicyReferenceOutputs& ref,
                                           const std::vector<uint8_t>& mask,
                                           const std::vector<double>& weight,
                                           const std::vector<double>& d, double n) {
  const PolicyParams& o = p.policy;
  const int64_t s = p.bt / o.sequences;
  const double lo = 1.0 - static_cast<double>(o.epsilon_low);
  const double hi = 1.0 + static_cast<double>(o.epsilon_high);
  const bool kl = p.ref_logp != nullptr && o.beta != 0.0f, bc = o.use_bias_correction_kl;
  const double beta = o.beta, gs = std::fabs(static_cast<double>(p.options.grad_scale));
  SequenceErrors out;
  out.c_slope.assign(p.bt, 0.0);
  for (int64_t b0 = 0; b0 < p.bt; b0 += s) {
    double dbar = 0, shared = 0, loss_r = 0, kl_r_sum = 0;
    std::vector<double> loss_own(s, 0.0), kl_own_err(s, 0.0);
    int64_t nb = 0;
    for (int64_t i = b0; i < b0 + s; ++i) nb += mask[i];
    for (int64_t i = b0; i < b0 + s && p.old_logp != nullptr; ++i) dbar += mask[i] ? d[i] : 0.0;
    dbar /= std::max<double>(1.0, static_cast<double>(nb));
    std::vector<double> f_own(s, 0.0), f_r(s, 0.0);
    for (int64_t i = b0; i < b0 + s; ++i) {
      if (!mask[i]) continue;
      const double a = p.advantages[i], r = ref.ratio[i];
      const double rho = p.is_ratio != nullptr ? p.is_ratio[i] : 1.0;
      const bool clipped = (r < lo && a < 0) || (r > hi && a > 0);
      const bool capped = o.delta != 0.0f && r >= o.delta && a < 0;
      const double share = clipped || capped ? 0.0 : (r == lo || r == hi) ? 0.5 : 1.0;
      double e_r = rho * share * std::fabs(a) * r, e_own = 0, kl_own = 0, kl_r = 0;
      if (p.ref_logp != nullptr) {
        const double ek = std::exp(p.ref_logp[i] - ref.logp[i]);
        const double k3 = ek - std::log(ek) - 1.0;
        kl_own = std::fabs(1.0 - ek) * (bc ? r : 1.0);
        kl_r = bc ? k3 * r : 0.0;
        if (kl) {
          e_r += beta * kl_r;
          e_own = bc ? beta * std::fabs(1.0 - ek) * r : 0.0;
          f_own[i - b0] = beta * ek * (bc ? r : 1.0);
          f_r[i - b0] = bc ? beta * std::fabs(1.0 - ek) * r : 0.0;
        }
      }
      shared += weight[i] * (e_r * dbar + e_own * d[i]);
      if (p.old_logp != nullptr) {
        loss_r += weight[i] * (rho * share * std::fabs(a) * r + (kl ? beta * kl_r : 0.0));
        kl_r_sum += kl_r;
      }
      loss_own[i - b0] = weight[i] * (kl ? beta * kl_own : 0.0);
      kl_own_err[i - b0] = kl_own;
    }
    const double n_b = std::max<double>(1.0, static_cast<double>(nb));
    shared /= n_b;
    for (int64_t i = b0; i < b0 + s; ++i) {
      if (!mask[i]) continue;
      out.loss.push_back((loss_r / n_b + loss_own[i - b0]) * d[i]);
      out.kl.push_back((kl_r_sum / n_b + kl_own_err[i - b0]) * d[i] / n);
      if (!(d[i] > 0)) continue;
      const double err = weight[i] * (f_own[i - b0] * d[i] + f_r[i - b0] * dbar) + shared;
      out.c_slope[i] = gs * err / d[i];
    }
  }
  return out;
}

// geo_mean (policy_reference.h): c_j = gs (w_j f_j + P_b g_j / n_b), P_b = -(1/B) mean(A)_b
// R_b rho_b, where R_b moves with the mean of the sequence's clipped log-ratios, each by at
// most its logp's bound d_k (not at all without old log-probs: R_b is then 1). First order,
//   |dc_j| <= |gs| (w_j |df_j/dlogp_j| d_j + |P_b| / n_b dbar_b)     (g_j <= 1)
// the first part (the KL term's) already in *c_slope; the loss's row k entry
// (|P_b| / n_b + w_k beta |dK_k/dlogp_k|) d_k.
inline void GeoMeanErrors(const LossProblem& p, const PolicyReferenceOutputs& ref,
                          const std::vector<uint8_t>& mask, const std::vector<double>& weight,
                          const std::vector<double>& kl_slope, const std::vector<double>& d,
                          std::vector<double>* c_slope, std::vector<double>* loss) {
  const PolicyParams& o = p.policy;
  const int64_t s = p.bt / o.sequences;
  const double gs = std::fabs(static_cast<double>(p.options.grad_scale));
  const double beta = p.ref_logp != nullptr ? static_cast<double>(o.beta) : 0.0;
  const bool moves = p.old_logp != nullptr;
  loss->assign(p.bt, 0.0);
  for (int64_t b0 = 0; b0 < p.bt; b0 += s) {
    double nb = 0, sum_a = 0, sum_log_rho = 0, dbar = 0, ratio = 1;
    for (int64_t i = b0; i < b0 + s; ++i) {
      if (!mask[i]) continue;
      nb += 1;
      sum_a += p.advantages[i];
      if (p.is_ratio != nullptr) sum_log_rho += std::log(p.is_ratio[i] + 1e-10);
      dbar += d[i];
      ratio = ref.ratio[i];
    }
    if (nb == 0) continue;
    dbar = moves ? dbar / nb : 0.0;
    const double rho = p.is_ratio != nullptr ? std::exp(sum_log_rho / nb) : 1.0;
    const double pg = std::fabs(sum_a / nb) * ratio * rho / static_cast<double>(o.sequences);
    for (int64_t i = b0; i < b0 + s; ++i) {
      if (!mask[i]) continue;
      (*loss)[i] = ((moves ? pg / nb : 0.0) + weight[i] * beta * kl_slope[i]) * d[i];
      if (d[i] > 0) (*c_slope)[i] += gs * pg / nb * dbar / d[i];
    }
  }
}

// vespo (policy_reference.h): c_j = gs w_j (-phi_j A_j + beta dK_j), phi_j its sequence's
// weight, which moves with every counted logp of the sequence through u by at most dphi_j
// (testing/cpu's VespoWeightsOf; 0 without old log-probs). The KL part is already in
// *c_slope; |dc_j| gains |gs| w_j |A_j| dphi_j. The loss's -phi A logp moves by w_j |A_j|
// (phi_j d_j, in the row's own entry, and |logp_j| dphi_j): the latter one entry per sequence,
// its rows' errors being one u's.
inline void VespoErrors(const LossProblem& p, const PolicyProblem& pp,
                        const PolicyReferenceOutputs& ref, const std::vector<uint8_t>& mask,
                        const std::vector<double>& weight, const std::vector<double>& d,
                        std::vector<double>* c_slope, std::vector<double>* loss) {
  const VespoWeights vw = VespoWeightsOf(pp, ref.logp, d);
  const int64_t s = p.bt / p.policy.sequences;
  const double gs = std::fabs(static_cast<double>(p.options.grad_scale));
  for (int64_t b0 = 0; b0 < p.bt; b0 += s) {
    double together = 0;
    for (int64_t i = b0; i < b0 + s; ++i) {
      if (!mask[i]) continue;
      const double a = std::fabs(static_cast<double>(p.advantages[i]));
      together += weight[i] * a * std::fabs(ref.logp[i]) * vw.dphi[i];
      if (d[i] > 0) (*c_slope)[i] += gs * weight[i] * a * vw.dphi[i] / d[i];
    }
    loss->push_back(together);
  }
}

inline Expected ExpectPolicy(const LossProblem& p, const Tolerance& tol) {
  std::vector<uint8_t> mask(p.bt);
  for (int64_t i = 0; i < p.bt; ++i) {
    mask[i] = LoadAsInt(p.targets, p.target_dtype, i) != p.options.ignore_index;
  }
  PolicyProblem pp;
  pp.head = HeadInputs{p.bt, p.h, p.v, p.dtype, p.x, p.w, p.bias};
  pp.batch = p.policy.sequences;
  pp.targets = p.targets;
  pp.target_dtype = p.target_dtype;
  pp.mask = mask.data();
  pp.advantages = p.advantages;
  pp.old_logp = p.old_logp;
  pp.ref_logp = p.ref_logp;
  pp.is_ratio = p.is_ratio;
  PolicyOptions& o = pp.options;
  o.loss_type = p.policy.loss_type;
  o.epsilon_low = p.policy.epsilon_low;
  o.epsilon_high = p.policy.epsilon_high;
  o.beta = p.policy.beta;
  o.temperature = p.options.temperature;
  o.softcap = p.options.softcap;
  o.max_completion_length = p.policy.max_completion_length;
  o.dapo_normalizer = p.policy.dapo_normalizer;
  o.grad_scale = p.options.grad_scale;
  o.sapo_temperature_pos = p.policy.sapo_temperature_pos;
  o.sapo_temperature_neg = p.policy.sapo_temperature_neg;
  o.delta = p.policy.delta;
  o.use_bias_correction_kl = p.policy.use_bias_correction_kl;
  o.importance_sampling = p.policy.importance_sampling;
  o.kl_estimator = p.policy.kl_estimator;
  o.kl_straight_through = p.policy.kl_straight_through;
  o.entropy_coeff = p.policy.entropy_coeff;
  o.aggregation = p.policy.aggregation;
  o.loss_scale_factor = p.policy.loss_scale_factor;
  o.kl_cov_ratio = p.policy.kl_cov_ratio;
  o.ppo_kl_coef = p.policy.ppo_kl_coef;
  o.vespo_k_pos = p.policy.vespo_k_pos;
  o.vespo_lambda_pos = p.policy.vespo_lambda_pos;
  o.vespo_k_neg = p.policy.vespo_k_neg;
  o.vespo_lambda_neg = p.policy.vespo_lambda_neg;
  PolicyReferenceOutputs ref;
  EXPECT_TRUE(PolicyReference(pp, &ref).ok());
  Expected e;
  e.logp = ref.logp;
  e.loss = ref.loss;
  e.kl = ref.kl;
  e.clip_fraction = ref.clip_fraction;
  e.grad = ref.grad;
  // Each row's c_i = grad_scale w_i dl_i/dlogp_i, and the slopes in logp of c_i, of its loss
  // term and of its KL term.
  const double n = std::max<double>(1.0, static_cast<double>(ref.tokens));
  const std::vector<double> weight = PolicyWeights(pp, mask, n);
  const double gs = p.options.grad_scale;
  const double lo = 1.0 - static_cast<double>(o.epsilon_low);
  const double hi = 1.0 + static_cast<double>(o.epsilon_high);
  RowCoefficients k;
  std::vector<double> loss_slope(p.bt, 0.0), kl_slope(p.bt, 0.0);
  // The entropy bonus's coefficient, a constant of the row: e_i = -gs w_i entropy_coeff.
  const double ec = p.policy.entropy_coeff;
  for (int64_t i = 0; i < p.bt; ++i) {
    k.e.push_back(mask[i] ? -gs * weight[i] * ec : 0.0);
    if (!mask[i]) {
      k.c.push_back(0.0);
      k.c_slope.push_back(0.0);
      continue;
    }
    // dl_i/dlogp_i is the reference's, and the slope of l_i itself but for cispo, whose
    // detached weight min(r, eh) moves its loss -min(r, eh) A logp by r A logp more.
    const double a = p.advantages[i], r = ref.ratio[i], dl = ref.dl_dlogp[i];
    // is_ratio's rho_i scales the surrogate's term (its value and slopes), not the KL's.
    const double rho = p.is_ratio != nullptr ? p.is_ratio[i] : 1.0;
    double slope = 0, value_slope = std::fabs(dl);
    if (o.loss_type == PolicyLossType::kCispo) {  // its coefficient -min(r, eh) A
      slope = rho * (r < o.epsilon_high ? std::fabs(a) * r : 0.0);
      value_slope += slope * std::fabs(ref.logp[i]);
    } else if (o.loss_type == PolicyLossType::kSapo) {  // sigmoid's first two derivatives <= 1/4
      const double tau = a > 0 ? o.sapo_temperature_pos : o.sapo_temperature_neg;
      slope = rho * std::fabs(a) * r * (1.0 + tau * r);
    } else if (o.loss_type == PolicyLossType::kGpg) {  // -A logp: a constant coefficient
      slope = 0.0;
    } else if (o.loss_type == PolicyLossType::kGeoMean) {  // its sequences': GeoMeanErrors
      slope = 0.0;
    } else if (o.loss_type == PolicyLossType::kVespo) {  // phi's move: VespoErrors
      slope = 0.0;
    } else if (o.loss_type == PolicyLossType::kKlCov) {  // -A r unclipped (+ c sign(d))
      slope = rho * std::fabs(a) * r;
    } else {
      const bool clipped = (r < lo && a < 0) || (r > hi && a > 0);
      const bool capped = o.delta != 0.0f && r >= o.delta && a < 0;
      const double share = clipped || capped ? 0.0 : (r == lo || r == hi) ? 0.5 : 1.0;
      slope = rho * share * std::fabs(a) * r;
    }
    if (p.ref_logp != nullptr) {
      const double ek = std::exp(p.ref_logp[i] - ref.logp[i]);
      const double k3 = ek - std::log(ek) - 1.0;
      if (o.kl_estimator == KlEstimator::kK3 && !o.kl_straight_through) {
        // The KL term k3 (times r when bias-corrected) and its coefficient 1 - ek (or
        // (1 - ek + k3) r): their slopes in logp.
        kl_slope[i] = o.use_bias_correction_kl ? (std::fabs(1.0 - ek) + k3) * r
                                               : std::fabs(1.0 - ek);
        if (o.beta != 0.0f) {
          slope += o.beta * (o.use_bias_correction_kl ? (2.0 + ek + k3) * r : ek);
        }
      } else {
        // The estimator K at d = logp - ref: its value kv and slope kp, the gradient g it
        // passes (k2's d with straight-through) and g's slope gp; low_var_kl is k3 inside its
        // clamps (|d| stays far below 20 here). Bias-corrected, K r: slope (kp + kv) r, and
        // its coefficient g r + K r moves by (gp + g + kp + kv) r.
        const double d = ref.logp[i] - p.ref_logp[i];
        double kv = k3, kp = std::fabs(1.0 - ek), g = kp, gp = ek;
        if (o.kl_estimator == KlEstimator::kK1 || o.kl_estimator == KlEstimator::kAbs) {
          kv = std::fabs(d), kp = 1.0, g = 1.0, gp = 0.0;
        } else if (o.kl_estimator == KlEstimator::kK2) {
          kv = d * d / 2, kp = std::fabs(d), g = std::fabs(d), gp = 1.0;
        }
        if (o.kl_straight_through) g = std::fabs(d), gp = 1.0;
        kl_slope[i] = o.use_bias_correction_kl ? (kp + kv) * r : kp;
        if (o.beta != 0.0f) {
          slope += o.beta * (o.use_bias_correction_kl ? (gp + g + kp + kv) * r : gp);
        }
      }
    }
    k.c.push_back(gs * weight[i] * dl);
    k.c_slope.push_back(std::fabs(gs) * weight[i] * slope);
    loss_slope[i] = weight[i] * value_slope;
  }
  HeadBounds b = FirstOrderBounds(p, k, tol.logit_u);
  RowBounds(b, tol, &e);
  std::vector<double> loss_errors, kl_errors;
  for (int64_t i = 0; i < p.bt; ++i) {
    loss_errors.push_back(loss_slope[i] * b.logp[i]);
    kl_errors.push_back(kl_slope[i] * b.logp[i] / n);
  }
  if (o.importance_sampling == ImportanceSampling::kSequence) {
    // logp's bounds do not depend on the coefficients: G's bound again with the slopes
    // through each sequence's ratio.
    SequenceErrors s = PolicySequenceErrors(p, ref, mask, weight, b.logp, n);
    k.c_slope = s.c_slope;
    b.grad_rel = FirstOrderBounds(p, k, tol.logit_u).grad_rel;
    loss_errors = s.loss;
    kl_errors = s.kl;
  }
  if (o.loss_type == PolicyLossType::kGeoMean) {
    GeoMeanErrors(p, ref, mask, weight, kl_slope, b.logp, &k.c_slope, &loss_errors);
    b.grad_rel = FirstOrderBounds(p, k, tol.logit_u).grad_rel;
  }
  if (o.loss_type == PolicyLossType::kVespo) {
    VespoErrors(p, pp, ref, mask, weight, b.logp, &k.c_slope, &loss_errors);
    b.grad_rel = FirstOrderBounds(p, k, tol.logit_u).grad_rel;
  }
  // The entropy bonus's term -entropy_coeff w_i H_i moves with H_i's own bound.
  for (int64_t i = 0; i < p.bt; ++i) loss_errors[i] += std::fabs(ec) * weight[i] * b.entropy[i];
  e.loss_bound = ScalarBound(loss_errors, e.loss, tol);
  e.kl_bound = ScalarBound(kl_errors, e.kl, tol);
  // The clip decisions are stable only where logp's error stays inside the ratios' distance
  // from the bounds (MakeProblem): each row's, or at sequence level the mean over its
  // sequence's counted rows (log R_b's error).
  const int64_t s = o.importance_sampling == ImportanceSampling::kSequence
                        ? p.bt / p.policy.sequences
                        : 1;
  for (int64_t b0 = 0; b0 < p.bt; b0 += s) {
    double sum = 0, count = 0;
    for (int64_t i = b0; i < b0 + s; ++i) {
      sum += mask[i] ? e.logp_bound[i] : 0.0;
      count += mask[i];
    }
    EXPECT_LT(sum / std::max(1.0, count), kClipMargin)
        << (s > 1 ? "sequence " : "row ") << b0 / s << ": a clip decision may flip";
  }
  e.grad_tol = GradTolerance(p, tol, b.grad_rel);
  return e;
}

// Distill's loss bound: per row, first order, |d row| <= (2 + 2 row) (|dz| + |dz_t|) (the
// student's and the teacher's logits' rounding; sum_j |d row / d z_j| <= 2 + 2 row for each
// side), over the rows' mean.
inline Expected ExpectDistill(const LossProblem& p, const LogitStats& stats,
                       const LogitStats& teacher_stats, const Tolerance& tol) {
  DistillProblem dp;
  dp.student = HeadInputs{p.bt, p.h, p.v, p.dtype, p.x, p.w, p.bias};
  dp.teacher = HeadInputs{p.bt, p.teacher_h, p.v, p.dtype, p.teacher_x, p.teacher_w,
                          p.teacher_bias};
  dp.labels = p.targets;
  dp.label_dtype = p.target_dtype;
  dp.options.jsd_beta = p.distill.jsd_beta;
  dp.options.temperature = p.options.temperature;
  dp.options.ignore_index = p.options.ignore_index;
  dp.options.grad_scale = p.options.grad_scale;
  dp.options.weight_hard_loss = p.distill.weight_hard_loss;
  dp.options.weight_soft_loss = p.distill.weight_soft_loss;
  DistillReferenceOutputs ref;
  EXPECT_TRUE(DistillReference(dp, &ref).ok());
  Expected e;
  e.loss = ref.loss;
  const double inv_t = 1.0 / p.options.temperature;
  const double n = std::max<double>(1.0, static_cast<double>(ref.tokens));
  // The hard term's cross-entropy at temperature 1 moves by at most |du_t| + sum p |du| <= 2
  // of the raw logits' rounding.
  const double ws = p.distill.weight_soft_loss, wh = p.distill.weight_hard_loss;
  std::vector<double> row_errors;
  for (int64_t i = 0; i < p.bt; ++i) {
    const double zm = tol.logit_u * (stats.row_abs_max[i] + teacher_stats.row_abs_max[i] + 2) *
                      inv_t;
    const double um = tol.logit_u * (stats.row_abs_max[i] + 1);
    row_errors.push_back((ws * (2 + 2 * ref.row_loss[i]) * zm + wh * 2 * um) / n);
  }
  e.loss_bound = ScalarBound(row_errors, e.loss, tol);
  e.grad = ref.grad;
  // A coarse bound of G's relative error (the JSD's gradient through both heads' rounding):
  // twice the two heads' rms logit rounding.
  // With the hard term, its softmax(u)'s relative error (twice the raw logits' rms rounding)
  // adds to the soft term's.
  const double grad_rel =
      (ws != 0 ? 2 * tol.logit_u * (stats.rms_row_abs_max + teacher_stats.rms_row_abs_max + 2) *
                     inv_t
               : 0.0) +
      (wh != 0 ? 2 * tol.logit_u * (stats.rms_row_abs_max + 1) : 0.0) + tol.logit_u;
  e.grad_tol = GradTolerance(p, tol, grad_rel);
  return e;
}

}  // namespace cuda
}  // namespace lossd

#endif  // LOSSD_TESTING_CUDA_ROW_LOSS_TEST_BOUNDS_H_
