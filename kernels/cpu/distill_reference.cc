// SPDX-License-Identifier: Apache-2.0
#include "kernels/cpu/distill_reference.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
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

  HeadRow s, t;
  std::vector<double> d, q, g;
  double total = 0;
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
    for (size_t j = 0; j < d.size(); ++j) g[j] = scale * (d[j] - q[j] * d_sum);
    student.AddGradients(s, g, &out->grad);
  }
  out->loss = total / static_cast<double>(out->tokens);
  return absl::OkStatus();
}

}  // namespace lossd
