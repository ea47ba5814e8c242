// SPDX-License-Identifier: Apache-2.0
#include "kernels/cpu/distill_reference.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "core/distill_topk_check.h"
#include "core/dtype.h"
#include "kernels/cpu/reference_head.h"

namespace lossd {
namespace {

const float kOne = 1.0f;  // the stand-in teacher head of a top-k problem

// The teacher: a head of the student's rows and vocabulary, or its top-k.
absl::Status CheckTeacher(const DistillProblem& p) {
  if (p.topk != 0) {
    DistillTopkView t;
    t.bt = p.student.bt;
    t.v = p.student.v;
    t.k = p.topk;
    t.ids = p.topk_ids;
    t.id_dtype = p.topk_id_dtype;
    t.logp = p.topk_logp;
    t.targets = p.labels;
    t.target_dtype = p.label_dtype;
    t.ignore_index = p.options.ignore_index;
    t.params.jsd_beta = p.options.jsd_beta;
    t.params.topk_tail = p.options.topk_tail;
    return CheckDistillTopk(t);
  }
  if (absl::Status s = CheckHeadInputs(p.teacher, "teacher"); !s.ok()) return s;
  if (p.teacher.bt != p.student.bt || p.teacher.v != p.student.v) {
    return absl::InvalidArgumentError(absl::StrCat(
        "teacher: rows and vocabulary (", p.teacher.bt, ", ", p.teacher.v,
        ") must equal the student's (", p.student.bt, ", ", p.student.v, ")"));
  }
  return absl::OkStatus();
}

absl::Status CheckProblem(const DistillProblem& p) {
  if (absl::Status s = CheckHeadInputs(p.student, "student"); !s.ok()) return s;
  const DistillOptions& o = p.options;
  if (!(o.jsd_beta >= 0.0f && o.jsd_beta <= 1.0f)) {
    return absl::InvalidArgumentError(
        absl::StrCat("options.jsd_beta must be in [0, 1], got ", o.jsd_beta));
  }
  if (absl::Status s = CheckTemperatureAndSoftcap(o.temperature, 0.0f); !s.ok()) return s;
  if (!std::isfinite(o.grad_scale)) {
    return absl::InvalidArgumentError(
        absl::StrCat("options.grad_scale must be finite, got ", o.grad_scale));
  }
  if (p.labels != nullptr && p.label_dtype != DType::kI32 && p.label_dtype != DType::kI64) {
    return absl::InvalidArgumentError(
        absl::StrCat("labels: dtype must be int32 or int64, got ", DTypeName(p.label_dtype)));
  }
  if (absl::Status s = CheckTeacher(p); !s.ok()) return s;
  const std::pair<const char*, float> weights[] = {{"weight_hard_loss", o.weight_hard_loss},
                                                   {"weight_soft_loss", o.weight_soft_loss}};
  for (const auto& [name, value] : weights) {
    if (!(value >= 0.0f) || !std::isfinite(value)) {
      return absl::InvalidArgumentError(
          absl::StrCat("options.", name, " must be finite and >= 0, got ", value));
    }
  }
  if (o.weight_hard_loss == 0.0f) return absl::OkStatus();
  if (p.labels == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "options.weight_hard_loss ", o.weight_hard_loss, " needs labels (the hard targets)"));
  }
  for (int64_t i = 0; i < p.student.bt; ++i) {
    const int64_t t = LoadAsInt(p.labels, p.label_dtype, i);
    if (t != o.ignore_index && (t < 0 || t >= p.student.v)) {
      return absl::InvalidArgumentError(absl::StrCat("labels[", i, "] = ", t,
                                                     " is outside [0, V=", p.student.v,
                                                     ") and is not ignore_index"));
    }
  }
  return absl::OkStatus();
}

bool Ignored(const DistillProblem& p, int64_t i) {
  return p.labels != nullptr && LoadAsInt(p.labels, p.label_dtype, i) == p.options.ignore_index;
}

// Row i's divergence, and d = d row / d log Q (V) into `d`.
double RowDivergence(double beta, const HeadRow& s, const HeadRow& t,
                     std::vector<double>* d) {  // (V)
  const size_t v = s.z.size();
  d->resize(v);
  double row = 0;
  for (size_t j = 0; j < v; ++j) {
    const double log_q = s.z[j] - s.lse, log_p = t.z[j] - t.lse;
    const double q = std::exp(log_q), pj = std::exp(log_p);
    if (beta == 0.0) {
      row += pj * (log_p - log_q);
      (*d)[j] = -pj;
    } else if (beta == 1.0) {
      row += q * (log_q - log_p);
      (*d)[j] = q * (log_q - log_p + 1.0);
    } else {
      // log M from the larger of the two logs, so that a tiny M does not underflow to 0.
      const double m = std::max(log_p, log_q);
      const double log_m =
          m + std::log(beta * std::exp(log_p - m) + (1.0 - beta) * std::exp(log_q - m));
      row += beta * pj * (log_p - log_m) + (1.0 - beta) * q * (log_q - log_m);
      (*d)[j] = (1.0 - beta) * q * (log_q - log_m);
    }
  }
  return row;
}

// One event's share of the divergence at beta (0 forward KL, 1 reverse, else the JSD through
// M = beta p + (1 - beta) q) and d = its derivative in log q. An event the teacher gives
// probability 0 (log_p -inf: an empty tail) adds nothing to the forward KL or to the JSD's
// teacher side. A copy of kind_rows.cc's on purpose: the oracle shares no code with the backend.
double EventTerm(double beta, double log_p, double log_q, double* d) {
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
  const double log_m = m + std::log(beta * std::exp(log_p - m) + (1.0 - beta) * std::exp(log_q - m));
  *d = (1.0 - beta) * q * (log_q - log_m);
  return (p == 0.0 ? 0.0 : beta * p * (log_p - log_m)) + (1.0 - beta) * q * (log_q - log_m);
}

double LogSumExp(const std::vector<double>& x) {
  double m = -INFINITY;
  for (double e : x) m = std::max(m, e);
  double sum = 0;
  for (double e : x) sum += std::exp(e - m);
  return m + std::log(sum);
}

// Row i's divergence from the teacher's top-k (ids, their log-probs lp) and dz = d row / dz
// (V), by the tail's treatment (distill_reference.h).
double TopkRow(double beta, DistillTopkTail tail, const HeadRow& s,
               const std::vector<int64_t>& ids,  // (k)
               const std::vector<double>& lp,    // (k)
               std::vector<double>* dz) {        // (V)
  const size_t v = s.z.size(), k = ids.size();
  std::vector<double> log_q(k), log_p(k), d(k);
  for (size_t a = 0; a < k; ++a) log_q[a] = s.z[ids[a]];
  const bool renormalize = tail == DistillTopkTail::kRenormalize;
  const double lse_q = renormalize ? LogSumExp(log_q) : s.lse;
  const double lse_p = renormalize ? LogSumExp(lp) : 0.0;
  double row = 0, d_sum = 0, p_sum = 0;
  for (size_t a = 0; a < k; ++a) {
    log_q[a] -= lse_q;
    log_p[a] = lp[a] - lse_p;
    row += EventTerm(beta, log_p[a], log_q[a], &d[a]);
    d_sum += d[a];
    p_sum += std::exp(lp[a]);
  }
  std::vector<uint8_t> listed(v, 0);
  for (int64_t id : ids) listed[id] = 1;
  // The tail event: the student's mass outside the ids, summed directly (1 - sum would
  // cancel), against the teacher's 1 - sum p (0 at most: an empty tail).
  double e_tail = 0;
  if (tail == DistillTopkTail::kBucket && k < v) {
    std::vector<double> rest;
    for (size_t j = 0; j < v; ++j) {
      if (!listed[j]) rest.push_back(s.z[j]);
    }
    const double log_q_tail = LogSumExp(rest) - s.lse;
    const double p_tail = std::max(0.0, 1.0 - p_sum);
    double d_tail = 0;
    row += EventTerm(beta, p_tail > 0 ? std::log(p_tail) : -INFINITY, log_q_tail, &d_tail);
    d_sum += d_tail;
    e_tail = d_tail / std::exp(log_q_tail);  // d log q_tail / dz_j = q_j / q_tail - q_j
  }
  dz->assign(v, 0.0);
  if (renormalize) {  // d log Q'_a / dz_j = [j = a] - Q'_j [j listed]
    for (size_t a = 0; a < k; ++a) (*dz)[ids[a]] = d[a] - std::exp(log_q[a]) * d_sum;
    return row;
  }
  for (size_t j = 0; j < v; ++j) {  // d log q_a / dz_j = [j = a] - q_j
    const double q = std::exp(s.z[j] - s.lse);
    (*dz)[j] = -q * d_sum + (listed[j] ? 0.0 : q * e_tail);
  }
  for (size_t a = 0; a < k; ++a) (*dz)[ids[a]] += d[a];
  return row;
}

// The hard-label term of row i with label t: ce = lse(u) - u_t at temperature 1 (u = z T),
// and its gradient in z, scale * (softmax(u)_j - [j = t]) * T (z = u / T), added into g.
double AddHardLoss(const HeadRow& s, int64_t t, double temperature, double scale,
                   std::vector<double>* g) {  // (V)
  const size_t v = s.z.size();
  double m = -INFINITY;
  for (double zj : s.z) m = std::max(m, zj * temperature);
  double sum = 0;
  for (double zj : s.z) sum += std::exp(zj * temperature - m);
  const double lse = m + std::log(sum);
  for (size_t j = 0; j < v; ++j) {
    const double pj = std::exp(s.z[j] * temperature - lse);
    (*g)[j] += scale * temperature * (pj - (static_cast<int64_t>(j) == t ? 1.0 : 0.0));
  }
  return lse - s.z[t] * temperature;
}

}  // namespace

absl::Status DistillReference(const DistillProblem& p, DistillReferenceOutputs* out) {
  if (out == nullptr) return absl::InvalidArgumentError("distill reference: out must be non-null");
  if (absl::Status s = CheckProblem(p); !s.ok()) return s;
  const DistillOptions& o = p.options;
  const int64_t bt = p.student.bt;
  const ReferenceHead student(p.student, 0.0, o.temperature);
  // With a top-k teacher its head is unused (and may be empty).
  const HeadInputs no_head{1, 1, 1, DType::kF32, &kOne, &kOne, nullptr};
  const ReferenceHead teacher(p.topk != 0 ? no_head : p.teacher, 0.0, o.temperature);
  *out = DistillReferenceOutputs();
  out->row_loss.assign(bt, 0.0);
  out->grad = student.ZeroGradients();
  for (int64_t i = 0; i < bt; ++i) out->tokens += Ignored(p, i) ? 0 : 1;
  if (out->tokens == 0) return absl::OkStatus();
  const double scale = static_cast<double>(o.grad_scale) / static_cast<double>(out->tokens);

  const double w_hard = o.weight_hard_loss, w_soft = o.weight_soft_loss;
  HeadRow s, t;
  std::vector<double> d, q, g, lp(static_cast<size_t>(p.topk));
  std::vector<int64_t> ids(static_cast<size_t>(p.topk));
  double total = 0, hard = 0;
  for (int64_t i = 0; i < bt; ++i) {
    if (Ignored(p, i)) continue;
    student.Row(i, &s);
    g.resize(s.z.size());
    if (p.topk != 0) {
      for (int64_t a = 0; a < p.topk; ++a) {
        ids[a] = LoadAsInt(p.topk_ids, p.topk_id_dtype, static_cast<size_t>(i * p.topk + a));
        lp[a] = p.topk_logp[i * p.topk + a];
      }
      out->row_loss[i] = TopkRow(o.jsd_beta, o.topk_tail, s, ids, lp, &d);
      for (size_t j = 0; j < d.size(); ++j) g[j] = scale * w_soft * d[j];
    } else {
      teacher.Row(i, &t);
      out->row_loss[i] = RowDivergence(o.jsd_beta, s, t, &d);
      // Through the student's log-softmax: dz_j = d_j - Q_j sum_k d_k.
      Softmax(s, &q);
      double d_sum = 0;
      for (double dj : d) d_sum += dj;
      for (size_t j = 0; j < d.size(); ++j) g[j] = scale * w_soft * (d[j] - q[j] * d_sum);
    }
    total += out->row_loss[i];
    if (w_hard != 0.0) {
      hard += AddHardLoss(s, LoadAsInt(p.labels, p.label_dtype, i), o.temperature,
                          scale * w_hard, &g);
    }
    student.AddGradients(s, g, &out->grad);
  }
  const double n = static_cast<double>(out->tokens);
  out->soft_loss = total / n;
  out->hard_loss = hard / n;
  out->loss = w_hard * out->hard_loss + w_soft * out->soft_loss;
  return absl::OkStatus();
}

}  // namespace lossd
