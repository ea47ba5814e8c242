// SPDX-License-Identifier: Apache-2.0
#include "kernels/cpu/reference_head.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "core/dtype.h"

namespace lossd {

absl::Status CheckHeadInputs(const HeadInputs& head, const char* name) {
  if (head.bt <= 0 || head.h <= 0 || head.v <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": shape (bt, h, v) must be positive, got (",
                                                   head.bt, ", ", head.h, ", ", head.v, ")"));
  }
  if (head.x == nullptr || head.w == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": x and w must be non-null"));
  }
  if (!IsFloatDType(head.dtype)) {
    return absl::InvalidArgumentError(absl::StrCat(
        name, ": dtype must be bf16, fp16 or fp32, got ", DTypeName(head.dtype)));
  }
  return absl::OkStatus();
}

absl::Status CheckTemperatureAndSoftcap(float temperature, float softcap) {
  if (!(temperature > 0.0f) || !std::isfinite(temperature)) {
    return absl::InvalidArgumentError(
        absl::StrCat("options.temperature must be finite and > 0, got ", temperature));
  }
  if (!(softcap >= 0.0f) || !std::isfinite(softcap)) {
    return absl::InvalidArgumentError(
        absl::StrCat("options.softcap must be finite and >= 0 (0 = off), got ", softcap));
  }
  return absl::OkStatus();
}

absl::Status CheckFinite(const float* values, int64_t n, const char* name) {
  if (values == nullptr) return absl::OkStatus();
  for (int64_t i = 0; i < n; ++i) {
    if (!std::isfinite(values[i])) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, "[", i, "] must be finite, got ", values[i]));
    }
  }
  return absl::OkStatus();
}

ReferenceHead::ReferenceHead(const HeadInputs& head, double softcap, double temperature)
    : head_(head), softcap_(softcap), inv_temperature_(1.0 / temperature) {
  const int64_t vh = head.v * head.h;
  w_.resize(static_cast<size_t>(vh));
  for (int64_t k = 0; k < vh; ++k) w_[k] = LoadAsFloat(head.w, head.dtype, k);
  if (head.bias != nullptr) {
    b_.resize(head.v);
    for (int64_t j = 0; j < head.v; ++j) b_[j] = LoadAsFloat(head.bias, head.dtype, j);
  }
}

void ReferenceHead::Row(int64_t i, HeadRow* row) const {
  const int64_t h = head_.h, v = head_.v;
  row->i = i;
  row->x.resize(h);
  row->z.resize(v);
  row->dz_du.resize(v);
  for (int64_t k = 0; k < h; ++k) row->x[k] = LoadAsFloat(head_.x, head_.dtype, i * h + k);
  double zmax = -INFINITY;
  for (int64_t j = 0; j < v; ++j) {
    double u = b_.empty() ? 0.0 : b_[j];
    const double* wj = &w_[j * h];
    for (int64_t k = 0; k < h; ++k) u += row->x[k] * wj[k];
    double dcap = 1.0;
    if (softcap_ > 0) {
      // The cross-entropy reference's softcap: u -> cap tanh(u / cap), before the temperature.
      const double th = std::tanh(u / softcap_);
      u = softcap_ * th;
      dcap = 1.0 - th * th;
    }
    row->z[j] = u * inv_temperature_;
    row->dz_du[j] = dcap * inv_temperature_;
    zmax = std::max(zmax, row->z[j]);
  }
  double sum = 0;
  for (int64_t j = 0; j < v; ++j) sum += std::exp(row->z[j] - zmax);
  row->lse = zmax + std::log(sum);
}

HeadGradients ReferenceHead::ZeroGradients() const {
  HeadGradients g;
  g.dx.assign(static_cast<size_t>(head_.bt * head_.h), 0.0);
  g.dw.assign(static_cast<size_t>(head_.v * head_.h), 0.0);
  if (head_.bias != nullptr) g.db.assign(head_.v, 0.0);
  return g;
}

void ReferenceHead::AddGradients(const HeadRow& row, const std::vector<double>& g,
                                 HeadGradients* out) const {
  const int64_t h = head_.h, v = head_.v;
  double* dxi = &out->dx[row.i * h];
  for (int64_t j = 0; j < v; ++j) {
    const double gj = g[j] * row.dz_du[j];
    const double* wj = &w_[j * h];
    double* dwj = &out->dw[j * h];
    for (int64_t k = 0; k < h; ++k) {
      dxi[k] += gj * wj[k];
      dwj[k] += gj * row.x[k];
    }
    if (!out->db.empty()) out->db[j] += gj;
  }
}

void Softmax(const HeadRow& row, std::vector<double>* p) {
  const size_t v = row.z.size();
  p->resize(v);
  for (size_t j = 0; j < v; ++j) (*p)[j] = std::exp(row.z[j] - row.lse);
}

}  // namespace lossd
