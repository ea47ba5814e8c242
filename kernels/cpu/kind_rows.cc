// SPDX-License-Identifier: Apache-2.0
#include "kernels/cpu/kind_rows.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "core/dtype.h"
#include "kernels/cpu/cpu_convert.h"
#include "kernels/cpu/row_math.h"

namespace lossd {
namespace {

// Inlined into each instruction-set variant of its caller (a call would run baseline code).
#define LOSSD_ROW_INLINE inline __attribute__((always_inline))

// z = softcap(round(u + b)) / T in place: the logits a GPU stores (u + b in the input dtype),
// then the softcap and the temperature in fp32.
LOSSD_ROW_INLINE void MakeLogits(const KindRowParams& kp, float* z) {
  const int64_t v = kp.v;
  if (kp.bias != nullptr) {
    for (int64_t j = 0; j < v; ++j) z[j] += kp.bias[j];
  }
  RoundInPlace(z, v, kp.dtype);
  if (kp.cap > 0) {
    const float cap = kp.cap, inv = 1.0f / kp.cap;
    for (int64_t j = 0; j < v; ++j) z[j] = cap * std::tanh(z[j] * inv);
  }
  if (kp.temperature != 1.0f) {
    const float inv_t = 1.0f / kp.temperature;
    for (int64_t j = 0; j < v; ++j) z[j] *= inv_t;
  }
}

// Max (first index reaching it) and log sum_j exp(z_j - max), in kLanes partial sums.
LOSSD_ROW_INLINE void MaxAndLogSum(const float* z, int64_t v, HeadRowStats* s) {
  int64_t arg = 0;
  const float m = RowMax(z, v, &arg);
  const double sum = SumExpBelowMax(z, v, m);
  s->max = m;
  s->argmax = arg;
  s->log_sum = static_cast<float>(std::log(sum));
  s->lse = m + std::log(sum);
}

#undef LOSSD_ROW_INLINE

}  // namespace

LOSSD_CPU_TARGET_CLONES
HeadRowStats HeadRowForward(const KindRowParams& kp, float* z, int64_t t, bool want_entropy) {
  const int64_t v = kp.v;
  HeadRowStats s;
  MakeLogits(kp, z);
  MaxAndLogSum(z, v, &s);
  if (t >= 0) s.logp = static_cast<double>(z[t]) - s.lse;
  if (t >= 0 && want_entropy) {
    // H = sum_j p_j (-log p_j): every term >= 0, so no cancellation against lse.
    const float m = s.max, ls = s.log_sum;
    float acc[kLanes] = {0};
    int64_t j = 0;
    for (; j + kLanes <= v; j += kLanes) {
      for (int l = 0; l < kLanes; ++l) {
        const float lp = (z[j + l] - m) - ls;
        acc[l] -= ExpNonPositive(lp) * lp;
      }
    }
    for (int l = 0; j < v; ++j, ++l) {
      const float lp = (z[j] - m) - ls;
      acc[l] -= ExpNonPositive(lp) * lp;
    }
    double h = 0;
    for (int l = 0; l < kLanes; ++l) h += acc[l];
    s.entropy = h;
  }
  return s;
}

LOSSD_CPU_TARGET_CLONES
void WriteLogprobGradient(const KindRowParams& kp, float* z, int64_t t, const HeadRowStats& s,
                          double a, double e) {
  const int64_t v = kp.v;
  const double inv_t = 1.0 / static_cast<double>(kp.temperature);
  const float af = static_cast<float>(a * inv_t), ef = static_cast<float>(e * inv_t);
  const float eh = static_cast<float>(e * inv_t * s.entropy);
  const float m = s.max, ls = s.log_sum;
  // The softcap's 1 - tanh^2, tanh = softcap(u) / cap = z T / cap, from the logit before it
  // is overwritten; 1 without a softcap.
  const float tc = kp.cap > 0 ? kp.temperature / kp.cap : 0.0f;
  const float th_t = z[t] * tc, f_t = 1.0f - th_t * th_t;
  if (ef == 0.0f && eh == 0.0f) {
    for (int64_t j = 0; j < v; ++j) {
      const float th = z[j] * tc;
      z[j] = -af * ExpNonPositive((z[j] - m) - ls) * (1.0f - th * th);
    }
  } else {
    for (int64_t j = 0; j < v; ++j) {
      const float lp = (z[j] - m) - ls, th = z[j] * tc;
      z[j] = -ExpNonPositive(lp) * (af + ef * lp + eh) * (1.0f - th * th);
    }
  }
  z[t] += af * f_t;
  RoundInPlace(z, v, kp.dtype);
}

// The terms of one logit's divergence: its share of the row and d = d row / d log q_j.
// beta 0 forward KL, 1 reverse KL, else the generalised JSD through M = beta P + (1 - beta) Q
// (log M from the larger of the two logs, so a tiny M does not underflow).
struct JsdTerm {
  float row, d, q;
};
inline __attribute__((always_inline)) JsdTerm Jsd(float lq, float lp, float beta, int mode) {
  const float q = ExpNonPositive(lq), p = ExpNonPositive(lp);
  if (mode == 0) return {p * (lp - lq), -p, q};
  if (mode == 1) return {q * (lq - lp), q * ((lq - lp) + 1.0f), q};
  const float mx = lp > lq ? lp : lq;
  const float lm =
      mx + std::log(beta * ExpNonPositive(lp - mx) + (1.0f - beta) * ExpNonPositive(lq - mx));
  const float dq = (1.0f - beta) * q * (lq - lm);
  return {beta * p * (lp - lm) + dq, dq, q};
}

namespace {

// The hard-label term's log-sum-exp of the unscaled logits z T (the max of z times T, T > 0):
// Liger takes the label's cross-entropy before the division by the temperature.
inline __attribute__((always_inline)) double UnscaledLse(const float* z, int64_t v, float t,
                                                         float z_max) {
  const float m = z_max * t;
  float acc[kLanes] = {0};
  for (int64_t j = 0; j < v; ++j) acc[j % kLanes] += ExpNonPositive(z[j] * t - m);
  double sum = 0;
  for (int l = 0; l < kLanes; ++l) sum += acc[l];
  return static_cast<double>(m) + std::log(sum);
}

}  // namespace

LOSSD_CPU_TARGET_CLONES
DistillRowResult DistillRow(const KindRowParams& student, const KindRowParams& teacher, float* zs,
                            float* zt, const DistillRowTerms& terms, double k, bool want_grad) {
  const int64_t v = student.v;
  HeadRowStats ss, ts;
  MakeLogits(student, zs);
  MaxAndLogSum(zs, v, &ss);
  MakeLogits(teacher, zt);
  MaxAndLogSum(zt, v, &ts);
  const double jsd_beta = terms.jsd_beta;
  const int mode = jsd_beta == 0.0 ? 0 : jsd_beta == 1.0 ? 1 : 2;
  const float beta = static_cast<float>(jsd_beta);
  const bool hard = terms.w_hard != 0.0;
  const float t = student.temperature;
  // At T 1 the unscaled logits are z: the student's own statistics.
  const double lse1 = !hard ? 0.0 : t == 1.0f ? ss.lse : UnscaledLse(zs, v, t, ss.max);
  const float ms = ss.max, lss = ss.log_sum, mt = ts.max, lst = ts.log_sum;
  // The row's divergence and sum_k d_k, in kLanes partial sums.
  float row[kLanes] = {0}, dsum[kLanes] = {0};
  for (int64_t j = 0; j < v; ++j) {
    const JsdTerm r = Jsd((zs[j] - ms) - lss, (zt[j] - mt) - lst, beta, mode);
    row[j % kLanes] += r.row;
    dsum[j % kLanes] += r.d;
  }
  DistillRowResult res;
  double d_total = 0;
  for (int l = 0; l < kLanes; ++l) {
    res.divergence += row[l];
    d_total += dsum[l];
  }
  res.lse = ss.lse;
  res.argmax = ss.argmax;
  if (hard) res.hard = lse1 - static_cast<double>(zs[terms.label]) * t;
  if (!want_grad) return res;
  // d row / d z_j = d_j - q_j sum_k d_k (through the student's log-softmax), then 1/T; the
  // hard term's d ce / d u_j = softmax(z T)_j - [j = label].
  const float kf = static_cast<float>(k * terms.w_soft / static_cast<double>(t));
  const float ds = static_cast<float>(d_total);
  if (!hard) {
    for (int64_t j = 0; j < v; ++j) {
      const JsdTerm r = Jsd((zs[j] - ms) - lss, (zt[j] - mt) - lst, beta, mode);
      zs[j] = kf * (r.d - r.q * ds);
    }
  } else {
    const float kh = static_cast<float>(k * terms.w_hard);
    const float l1 = static_cast<float>(lse1);
    for (int64_t j = 0; j < v; ++j) {
      const JsdTerm r = Jsd((zs[j] - ms) - lss, (zt[j] - mt) - lst, beta, mode);
      zs[j] = kf * (r.d - r.q * ds) + kh * ExpNonPositive(zs[j] * t - l1);
    }
    zs[terms.label] -= kh;
  }
  RoundInPlace(zs, v, student.dtype);
  return res;
}

namespace {

// One event's share of the divergence at beta and d = its derivative in log q, in double (the
// reference's EventTerm): an event of teacher probability 0 (an empty tail) adds nothing to
// the forward KL or to the JSD's teacher side.
inline double TopkEvent(double beta, double log_p, double log_q, double* d) {
  const double p = std::exp(log_p), q = std::exp(log_q);
  if (beta == 0.0) {
    *d = -p;
    return p == 0.0 ? 0.0 : p * (log_p - log_q);
  }
  if (beta == 1.0) {
    *d = q * (log_q - log_p + 1.0);
    return q * (log_q - log_p);
  }
  const double m = std::max(log_p, log_q);
  const double log_m =
      m + std::log(beta * std::exp(log_p - m) + (1.0 - beta) * std::exp(log_q - m));
  *d = (1.0 - beta) * q * (log_q - log_m);
  return (p == 0.0 ? 0.0 : beta * p * (log_p - log_m)) + (1.0 - beta) * q * (log_q - log_m);
}

template <typename T>
double LogSumExpOf(const T* x, int64_t n) {
  double m = -INFINITY, sum = 0;
  for (int64_t a = 0; a < n; ++a) m = std::max(m, static_cast<double>(x[a]));
  for (int64_t a = 0; a < n; ++a) sum += std::exp(static_cast<double>(x[a]) - m);
  return m + std::log(sum);
}

// Row state's events: d_a for each id (lp_a and log q_a from the state), in double.
inline void TopkEvents(const TopkTeacherRow& t, const float* saved, const TopkRowState& st,
                       double beta, double* d) {
  for (int64_t a = 0; a < t.k; ++a) {
    TopkEvent(beta, t.logp[a] - st.lse_p, saved[a] - st.lse_q, &d[a]);
  }
}

}  // namespace

LOSSD_CPU_TARGET_CLONES
TopkRowState DistillTopkForward(const KindRowParams& student, float* zs, const TopkTeacherRow& t,
                                const DistillRowTerms& terms) {
  const int64_t v = student.v, n = t.k;
  TopkRowState st;
  MakeLogits(student, zs);
  MaxAndLogSum(zs, v, &st.stats);
  int64_t id[kMaxDistillTopk];
  float saved[kMaxDistillTopk];  // the ids' logits
  for (int64_t a = 0; a < n; ++a) {
    id[a] = LoadAsInt(t.ids, t.id_dtype, static_cast<size_t>(a));
    saved[a] = zs[id[a]];
  }
  const bool renormalize = t.tail == DistillTopkTail::kRenormalize;
  st.lse_q = renormalize ? LogSumExpOf(saved, n) : st.stats.lse;
  st.lse_p = renormalize ? LogSumExpOf(t.logp, n) : 0.0;
  const double beta = terms.jsd_beta;
  double p_sum = 0;
  double d[kMaxDistillTopk];
  for (int64_t a = 0; a < n; ++a) {
    st.divergence += TopkEvent(beta, t.logp[a] - st.lse_p, saved[a] - st.lse_q, &d[a]);
    st.d_sum += d[a];
    p_sum += std::exp(static_cast<double>(t.logp[a]));
  }
  if (t.tail == DistillTopkTail::kBucket && n < v) {
    // The student's mass outside the ids, summed directly (1 - the ids' sum would cancel):
    // their logits set to -inf add ExpNonPositive's floor, ~1e-38 each, then come back.
    for (int64_t a = 0; a < n; ++a) zs[id[a]] = -INFINITY;
    float acc[kLanes] = {0};
    for (int64_t j = 0; j < v; ++j) acc[j % kLanes] += ExpNonPositive(zs[j] - st.stats.max);
    for (int64_t a = 0; a < n; ++a) zs[id[a]] = saved[a];
    double rest = 0;
    for (int l = 0; l < kLanes; ++l) rest += acc[l];
    const double log_q_tail = static_cast<double>(st.stats.max) + std::log(rest) - st.stats.lse;
    const double p_tail = std::max(0.0, 1.0 - p_sum);
    double d_tail = 0;
    st.divergence +=
        TopkEvent(beta, p_tail > 0 ? std::log(p_tail) : -INFINITY, log_q_tail, &d_tail);
    st.d_sum += d_tail;
    st.e_tail = d_tail / std::exp(log_q_tail);
  }
  const float temp = student.temperature;
  if (terms.w_hard != 0.0) {
    st.lse1 = temp == 1.0f ? st.stats.lse : UnscaledLse(zs, v, temp, st.stats.max);
    st.hard = st.lse1 - static_cast<double>(zs[terms.label]) * temp;
  }
  // |G_j| / k: the ids' |d_a - q_a sum d| exactly; the rest's q_j |e_tail - sum d| with the
  // largest q; the hard term's at most 1.
  double g_ids = 0;
  for (int64_t a = 0; a < n; ++a) {
    g_ids = std::max(g_ids, std::abs(d[a] - std::exp(saved[a] - st.lse_q) * st.d_sum));
  }
  const double rest_coef = renormalize ? 0.0 : std::abs(st.e_tail - st.d_sum);
  const double q_max = std::exp(-static_cast<double>(st.stats.log_sum));
  st.g_bound = terms.w_soft / temp * std::max(g_ids, rest_coef * q_max) + terms.w_hard;
  return st;
}

LOSSD_CPU_TARGET_CLONES
void WriteTopkGradient(const KindRowParams& student, float* zs, const TopkTeacherRow& t,
                       const DistillRowTerms& terms, const TopkRowState& st, double k) {
  const int64_t v = student.v, n = t.k;
  int64_t id[kMaxDistillTopk];
  float saved[kMaxDistillTopk];
  double d[kMaxDistillTopk];
  for (int64_t a = 0; a < n; ++a) {
    id[a] = LoadAsInt(t.ids, t.id_dtype, static_cast<size_t>(a));
    saved[a] = zs[id[a]];
  }
  TopkEvents(t, saved, st, terms.jsd_beta, d);
  // An id's d log q / dz_j = [j = id] - q_j (renormalize: - Q'_j over the ids only); the
  // tail's [j not an id] q_j / q_tail - q_j. So every j not an id takes q_j (e_tail - sum d)
  // (renormalize: 0), and each id d_a - q_a sum d; the hard term adds softmax(z T) - onehot.
  const bool hard = terms.w_hard != 0.0;
  const float temp = student.temperature;
  const float kf = static_cast<float>(k * terms.w_soft / static_cast<double>(temp));
  const float kh = static_cast<float>(k * terms.w_hard);
  const bool renormalize = t.tail == DistillTopkTail::kRenormalize;
  const float rest_coef = renormalize ? 0.0f : static_cast<float>(st.e_tail - st.d_sum);
  const float ms = st.stats.max, ls = st.stats.log_sum, l1 = static_cast<float>(st.lse1);
  if (!hard) {
    for (int64_t j = 0; j < v; ++j) zs[j] = kf * rest_coef * ExpNonPositive((zs[j] - ms) - ls);
  } else {
    for (int64_t j = 0; j < v; ++j) {
      zs[j] = kf * rest_coef * ExpNonPositive((zs[j] - ms) - ls) +
              kh * ExpNonPositive(zs[j] * temp - l1);
    }
  }
  for (int64_t a = 0; a < n; ++a) {
    const double q = std::exp(static_cast<double>(saved[a]) - st.lse_q);
    double g = static_cast<double>(kf) * (d[a] - q * st.d_sum);
    if (hard) g += static_cast<double>(kh) * std::exp(static_cast<double>(saved[a]) * temp - st.lse1);
    zs[id[a]] = static_cast<float>(g);
  }
  if (hard) zs[terms.label] -= kh;
  RoundInPlace(zs, v, student.dtype);
}

}  // namespace lossd
