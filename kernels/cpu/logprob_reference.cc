// SPDX-License-Identifier: Apache-2.0
#include "kernels/cpu/logprob_reference.h"

#include <cmath>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "core/dtype.h"
#include "kernels/cpu/reference_head.h"

namespace lossd {

absl::Status CheckTargets(const void* targets, DType target_dtype, int64_t bt, int64_t v,
                          int64_t ignore_index, const char* name) {
  if (targets == nullptr) return absl::InvalidArgumentError(absl::StrCat(name, " must be non-null"));
  if (target_dtype != DType::kI32 && target_dtype != DType::kI64) {
    return absl::InvalidArgumentError(absl::StrCat(
        name, ": dtype must be int32 or int64, got ", DTypeName(target_dtype)));
  }
  for (int64_t i = 0; i < bt; ++i) {
    const int64_t t = LoadAsInt(targets, target_dtype, i);
    if (t == ignore_index) continue;
    if (t < 0 || t >= v) {
      return absl::InvalidArgumentError(absl::StrCat(name, "[", i, "] = ", t,
                                                     " is outside [0, ", v, ") and is not ",
                                                     "options.ignore_index (", ignore_index, ")"));
    }
  }
  return absl::OkStatus();
}

double RowLogprob(const HeadRow& row, int64_t t) { return row.z[t] - row.lse; }

double RowEntropy(const HeadRow& row, const std::vector<double>& p) {
  double mean_z = 0;
  for (size_t j = 0; j < p.size(); ++j) mean_z += p[j] * row.z[j];
  return row.lse - mean_z;
}

void LogprobLogitGradient(const HeadRow& row, const std::vector<double>& p, int64_t t,
                          double dlogp, double dentropy, std::vector<double>* g) {
  const size_t v = p.size();
  g->resize(v);
  const double entropy = dentropy != 0 ? RowEntropy(row, p) : 0.0;
  for (size_t j = 0; j < v; ++j) {
    const double hot = static_cast<int64_t>(j) == t ? 1.0 : 0.0;
    const double logp_j = row.z[j] - row.lse;
    (*g)[j] = dlogp * (hot - p[j]) - dentropy * p[j] * (logp_j + entropy);
  }
}

absl::Status LogprobReference(const LogprobProblem& p, LogprobReferenceOutputs* out) {
  if (out == nullptr) return absl::InvalidArgumentError("logprob reference: out must be non-null");
  const LogprobOptions& o = p.options;
  if (absl::Status s = CheckHeadInputs(p.head, "head"); !s.ok()) return s;
  if (absl::Status s = CheckTemperatureAndSoftcap(o.temperature, o.softcap); !s.ok()) return s;
  const int64_t bt = p.head.bt, v = p.head.v;
  if (absl::Status s = CheckTargets(p.targets, p.target_dtype, bt, v, o.ignore_index, "targets");
      !s.ok()) {
    return s;
  }
  if (absl::Status s = CheckFinite(p.dlogp, bt, "dlogp"); !s.ok()) return s;
  if (absl::Status s = CheckFinite(p.dentropy, bt, "dentropy"); !s.ok()) return s;

  const ReferenceHead head(p.head, o.softcap, o.temperature);
  *out = LogprobReferenceOutputs();
  out->logp.assign(bt, 0.0);
  out->entropy.assign(bt, 0.0);
  out->lse.assign(bt, 0.0);
  out->grad = head.ZeroGradients();
  HeadRow row;
  std::vector<double> prob, g;
  for (int64_t i = 0; i < bt; ++i) {
    head.Row(i, &row);
    out->lse[i] = row.lse;
    const int64_t t = LoadAsInt(p.targets, p.target_dtype, i);
    if (t == o.ignore_index) continue;
    ++out->tokens;
    Softmax(row, &prob);
    out->logp[i] = RowLogprob(row, t);
    out->entropy[i] = RowEntropy(row, prob);
    const double dlogp = p.dlogp != nullptr ? p.dlogp[i] : 0.0;
    const double dentropy = p.dentropy != nullptr ? p.dentropy[i] : 0.0;
    if (dlogp == 0 && dentropy == 0) continue;
    LogprobLogitGradient(row, prob, t, dlogp, dentropy, &g);
    head.AddGradients(row, g, &out->grad);
  }
  return absl::OkStatus();
}

}  // namespace lossd
