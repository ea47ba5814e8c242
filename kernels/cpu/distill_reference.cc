// SPDX-License-Identifier: Apache-2.0
#include "kernels/cpu/distill_reference.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "core/dtype.h"
#include "kernels/cpu/reference_head.h"

namespace lossd {
namespace {

absl::Status CheckProblem(const DistillProblem& p) {
  if (absl::Status s = CheckHeadInputs(p.student, "student"); !s.ok()) return s;
  if (absl::Status s = CheckHeadInputs(p.teacher, "teacher"); !s.ok()) return s;
  if (p.teacher.bt != p.student.bt || p.teacher.v != p.student.v) {
    return absl::InvalidArgumentError(absl::StrCat(
        "teacher: rows and vocabulary (", p.teacher.bt, ", ", p.teacher.v,
        ") must equal the student's (", p.student.bt, ", ", p.student.v, ")"));
  }
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
  const ReferenceHead teacher(p.teacher, 0.0, o.temperature);
  *out = DistillReferenceOutputs();
  out->row_loss.assign(bt, 0.0);
  out->grad = student.ZeroGradients();
  for (int64_t i = 0; i < bt; ++i) out->tokens += Ignored(p, i) ? 0 : 1;
  if (out->tokens == 0) return absl::OkStatus();
  const double scale = static_cast<double>(o.grad_scale) / static_cast<double>(out->tokens);

  const double w_hard = o.weight_hard_loss, w_soft = o.weight_soft_loss;
  HeadRow s, t;
  std::vector<double> d, q, g;
  double total = 0, hard = 0;
  for (int64_t i = 0; i < bt; ++i) {
    if (Ignored(p, i)) continue;
    student.Row(i, &s);
    teacher.Row(i, &t);
    out->row_loss[i] = RowDivergence(o.jsd_beta, s, t, &d);
    total += out->row_loss[i];
    // Through the student's log-softmax: dz_j = d_j - Q_j sum_k d_k.
    Softmax(s, &q);
    double d_sum = 0;
    for (double dj : d) d_sum += dj;
    g.resize(d.size());
    for (size_t j = 0; j < d.size(); ++j) g[j] = scale * w_soft * (d[j] - q[j] * d_sum);
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
