// SPDX-License-Identifier: Apache-2.0
// The policy kind's math for one row (kPolicy, core/loss_problem.h), in double, shared by the
// CPU backend, the CUDA backend's host code and its row kernels, so that every backend
// computes the same formulas: the loss type's surrogate, the KL estimator, and a row's terms
// with their derivatives in logp. The formulas are the float64 reference's
// (kernels/cpu/policy_reference.h), written again here so that the reference stays the
// independent oracle. Plain data and plain arithmetic: no core/ types (nvcc compiles this for
// the device), the loss type and estimator as core's enum values (kernels/policy_rows.cc
// checks they agree).
#ifndef LOSSD_KERNELS_POLICY_MATH_H_
#define LOSSD_KERNELS_POLICY_MATH_H_

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define LOSSD_POLICY_FN __host__ __device__ __forceinline__
#else
#define LOSSD_POLICY_FN inline
#endif

namespace lossd {
namespace policy_math {

// lossd::PolicyLossType's values.
inline constexpr int32_t kDapo = 0, kGrpo = 1, kBnpo = 2, kDrGrpo = 3, kCispo = 4, kSapo = 5,
                         kLuspo = 6, kGpg = 7, kGeoMean = 8, kKlCov = 9,
                         kVespo = 10, kCispoClamp = 11;
// lossd::KlEstimator's values.
inline constexpr int32_t kK3 = 0, kK1 = 1, kK2 = 2, kAbs = 3, kLowVarKl = 4;

// The options a row's terms read (PolicyParams' per-row ones).
struct RowOptions {
  int32_t loss_type = kDapo;
  float epsilon_low = 0.2f, epsilon_high = 0.2f;
  float beta = 0.0f;  // the KL term's coefficient (0: no term)
  float sapo_temperature_pos = 1.0f, sapo_temperature_neg = 1.05f;
  float delta = 0.0f;  // the clipped types' cap on r; 0 = none
  int32_t use_bias_correction_kl = 0;
  int32_t kl_estimator = kK3;
  int32_t kl_straight_through = 0;
  float entropy_coeff = 0.0f;
};

// One row's terms, before its weight.
struct RowTerms {
  double loss = 0;  // l_i = pg_i (times rho_i) + beta kl_i - entropy_coeff H_i
  double kl = 0;    // kl_i (times r with the bias correction)
  bool clipped = false;
  // dl_i/dlogp_i: at token level all of it; at sequence level the part that does not pass
  // through the ratio, `via_ratio` being dl_i/dr times r, which reaches every token of the
  // sequence through the mean of its log-ratios.
  double dlogp = 0;
  double via_ratio = 0;
  double dentropy = 0;  // dl_i/dH_i: -entropy_coeff
};

// The surrogate of a row at ratio r, advantage a and log-prob logp, and its derivative in logp
// (at token level, where r' = r). On a clamp bound r A gets half the gradient and delta's cap
// none, as torch's clamp and min give them.
LOSSD_POLICY_FN double Surrogate(const RowOptions& o, double r, double a, double logp,
                                 bool* clipped, double* dlogp) {
  *clipped = false;
  if (o.loss_type == kGeoMean || o.loss_type == kVespo) {
    // No surrogate of r: geo_mean's is its sequence's (GeoMeanLogRatio), vespo's its
    // sequence's weight times logp (VespoWeight).
    *dlogp = 0;
    return 0;
  }
  if (o.loss_type == kKlCov) {  // -A r, unclipped (its penalty: PolicySequenceRows)
    *dlogp = -a * r;
    return -a * r;
  }
  if (o.loss_type == kGpg) {  // -A logp: no ratio
    *dlogp = -a;
    return -a * logp;
  }
  if (o.loss_type == kCispoClamp) {  // -sg(clamp(r, 1 - eps_low, 1 + eps_high)) A logp
    const double lo = 1.0 - static_cast<double>(o.epsilon_low);
    const double hi = 1.0 + static_cast<double>(o.epsilon_high);
    const double weight = fmin(fmax(r, lo), hi);
    *clipped = r < lo || r > hi;  // verl's clip fraction: any clamped token, either sign of A
    *dlogp = -weight * a;
    return -weight * a * logp;
  }
  if (o.loss_type == kCispo) {  // -sg(min(r, eps_high)) A logp
    const double weight = fmin(r, static_cast<double>(o.epsilon_high));
    *clipped = r > static_cast<double>(o.epsilon_high) && a > 0;
    *dlogp = -weight * a;
    return -weight * a * logp;
  }
  if (o.loss_type == kSapo) {  // -A (4 / tau) sigmoid(tau (r - 1))
    const double tau =
        static_cast<double>(a > 0 ? o.sapo_temperature_pos : o.sapo_temperature_neg);
    const double g = 1.0 / (1.0 + exp(-tau * (r - 1.0)));
    const double g_rest = 1.0 / (1.0 + exp(tau * (r - 1.0)));  // 1 - g, no cancellation
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
  return -fmin(q * a, fmin(fmax(r, lo), hi) * a);
}

// geo_mean (verl's GMPO): the log-ratio d = logp - old clipped to [-eps_low, eps_high] on the
// side the advantage's sign s picks, s min(s d, s clamp(d)), and its slope in d: 0 where a = 0
// or the clamp holds (*clipped), else 1 (on the tie s d = s clamp(d) torch's min gives each
// side half and clamp passes its half whole).
LOSSD_POLICY_FN double GeoMeanLogRatio(const RowOptions& o, double d, double a, bool* clipped,
                                       double* slope) {
  const double c = fmin(fmax(d, -static_cast<double>(o.epsilon_low)),
                        static_cast<double>(o.epsilon_high));
  const double s = a > 0 ? 1.0 : a < 0 ? -1.0 : 0.0;
  *clipped = s * d > s * c;
  *slope = (s == 0.0 || *clipped) ? 0.0 : 1.0;
  return s * fmin(s * d, s * c);
}

// vespo's gamma weight of a sequence from u, its summed log-ratio (each counted token's
// clamped to [-20, 20]) plus its summed log rollout correction (each row's clamped to
// [log 1e-8, 20]): log w = clamp(u, log 1e-8, 20), phi = exp(lambda + k log w - lambda w) with
// lambda at least 1e-4, 0 where that is not finite (Liger's nan_to_num). phi(1) = 1. It is a
// constant of the gradient: the row's policy term is -phi A logp.
LOSSD_POLICY_FN double VespoWeight(double u, double k, double lambda) {
  const double log_w = fmin(fmax(u, log(1e-8)), 20.0);
  const double l = fmax(lambda, 1e-4);
  const double phi = exp(l + k * log_w - l * exp(log_w));
  return phi < HUGE_VAL ? phi : 0.0;  // phi >= 0: false for inf and NaN alike
}

// The KL estimator at d = logp - ref and the gradient its term passes to logp (k2's, d, when
// straight-through). low_var_kl is verl's k3: its clamps pass nothing where they hold.
LOSSD_POLICY_FN double KlEstimate(const RowOptions& o, double d, double* dk) {
  double k = 0;
  switch (o.kl_estimator) {
    case kK1:
      k = d;
      *dk = 1.0;
      break;
    case kK2:
      k = 0.5 * d * d;
      *dk = d;
      break;
    case kAbs:
      k = fabs(d);
      *dk = d > 0 ? 1.0 : d < 0 ? -1.0 : 0.0;
      break;
    case kLowVarKl: {
      const double c = fmin(fmax(-d, -20.0), 20.0);
      const double k3 = exp(c) - c - 1.0;
      k = fmin(k3, 10.0);
      *dk = (fabs(d) <= 20.0 && k3 <= 10.0) ? 1.0 - exp(c) : 0.0;
      break;
    }
    default:  // kK3
      k = exp(-d) + d - 1.0;
      *dk = 1.0 - exp(-d);
      break;
  }
  if (o.kl_straight_through != 0) *dk = d;
  return k;
}

// A row's terms from its log-prob, its entropy (read only with entropy_coeff != 0), the ratio
// r (its own at token level; its sequence's with `sequence`), the advantage a, the rollout
// correction rho (1: none) and, with has_ref, the reference log-prob.
LOSSD_POLICY_FN RowTerms Terms(const RowOptions& o, double logp, double entropy, double r,
                               double a, double rho, bool has_ref, double ref, bool sequence) {
  RowTerms t;
  t.loss = Surrogate(o, r, a, logp, &t.clipped, &t.dlogp);
  t.loss *= rho;  // the rollout correction, on the policy term only
  t.dlogp *= rho;
  if (sequence) {  // the clipped types' surrogate is all via r
    t.via_ratio = t.dlogp;
    t.dlogp = 0;
  }
  if (o.beta != 0.0f && has_ref) {
    double dkl = 0;
    const double k = KlEstimate(o, logp - ref, &dkl);
    t.kl = k;
    if (o.use_bias_correction_kl != 0) {  // K r, and (K r)' = K' r + K r', r' = r
      t.kl = k * r;
      if (sequence) {
        t.via_ratio += static_cast<double>(o.beta) * k * r;
        dkl *= r;
      } else {
        dkl = dkl * r + k * r;
      }
    }
    t.loss += static_cast<double>(o.beta) * t.kl;
    t.dlogp += static_cast<double>(o.beta) * dkl;
  }
  if (o.entropy_coeff != 0.0f) {
    t.loss -= static_cast<double>(o.entropy_coeff) * entropy;
    t.dentropy = -static_cast<double>(o.entropy_coeff);
  }
  return t;
}

}  // namespace policy_math
}  // namespace lossd

#endif  // LOSSD_KERNELS_POLICY_MATH_H_
