#include "kernels/cpu/reference.h"

#include <cmath>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "core/dtype.h"
#include "core/loss_problem.h"
#include "core/loss_problem_check.h"

namespace lossd {

absl::Status ReferenceCompute(const LossProblem& p, ReferenceOutputs* out) {
  if (out == nullptr) return absl::InvalidArgumentError("reference: out must be non-null");
  // Validated by the caller (core/loss_problem_check.h); debug builds check again.
  LOSSD_DCHECK_VALID_PROBLEM(p, nullptr, "reference");
  // What the reference cannot do, in any problem: it reads W on the host.
  if (p.w_memory != Memory::kHost) {
    return absl::InvalidArgumentError("reference: w_memory must be kHost");
  }

  const int64_t bt = p.bt, h = p.h, v = p.v;
  const LossOptions& o = p.options;
  const double eps = o.label_smoothing;
  const double zs = o.z_loss_scale;
  const double cap = o.softcap;
  const bool none = o.reduction == Reduction::kNone;

  // W widened once (V x H doubles, the size of dW itself); X one row at a time.
  std::vector<double> w(static_cast<size_t>(v * h));
  for (int64_t k = 0; k < v * h; ++k) w[k] = LoadAsFloat(p.w, p.dtype, k);
  std::vector<double> cw(v, 1.0);
  if (p.class_weights != nullptr) {
    for (int64_t j = 0; j < v; ++j) cw[j] = p.class_weights[j];
  }
  double cw_sum = 0;  // S in the smoothing gradient
  for (int64_t j = 0; j < v; ++j) cw_sum += cw[j];

  // Pass 1: targets, the non-ignored count and the class-weight sum (mean's denominators are
  // needed before any gradient row).
  std::vector<int64_t> targets(bt);
  std::vector<bool> ignored(bt);
  int64_t tokens = 0;
  double weight_sum = 0;
  for (int64_t i = 0; i < bt; ++i) {
    const int64_t t = LoadAsInt(p.targets, p.target_dtype, i);
    targets[i] = t;
    ignored[i] = (t == o.ignore_index);
    if (ignored[i]) continue;
    ++tokens;
    weight_sum += cw[t];
  }

  // Gradient scales of the cross-entropy part and of the z-loss part.
  double ce_scale = o.grad_scale, z_scale = o.grad_scale;
  if (o.reduction == Reduction::kMean) {
    ce_scale = weight_sum != 0 ? o.grad_scale / weight_sum : 0.0;
    z_scale = tokens != 0 ? o.grad_scale / static_cast<double>(tokens) : 0.0;
  }

  *out = ReferenceOutputs();
  out->loss.assign(none ? bt : 1, 0.0);
  out->z_loss.assign(none ? bt : 1, 0.0);
  out->lse.assign(bt, 0.0);
  out->predictions.assign(bt, 0);
  out->tokens = tokens;
  out->dx.assign(static_cast<size_t>(bt * h), 0.0);
  out->dw.assign(static_cast<size_t>(v * h), 0.0);
  if (p.bias != nullptr) out->db.assign(v, 0.0);

  std::vector<double> x(h), z(v), dcap(v, 1.0), g(v);
  double ce_total = 0, z_total = 0;
  int64_t correct = 0;
  for (int64_t i = 0; i < bt; ++i) {
    for (int64_t k = 0; k < h; ++k) x[k] = LoadAsFloat(p.x, p.dtype, i * h + k);
    // Final logits z = softcap(x W^T + b).
    for (int64_t j = 0; j < v; ++j) {
      double acc = p.bias != nullptr ? LoadAsFloat(p.bias, p.dtype, j) : 0.0;
      const double* wj = &w[j * h];
      for (int64_t k = 0; k < h; ++k) acc += x[k] * wj[k];
      if (cap > 0) {
        const double th = std::tanh(acc / cap);
        acc = cap * th;
        dcap[j] = 1.0 - th * th;
      }
      z[j] = acc;
    }
    int64_t arg = 0;
    double zmax = z[0];
    for (int64_t j = 1; j < v; ++j) {
      if (z[j] > zmax) {  // strict: the first index wins ties
        zmax = z[j];
        arg = j;
      }
    }
    double sum = 0;
    for (int64_t j = 0; j < v; ++j) sum += std::exp(z[j] - zmax);
    const double lse = zmax + std::log(sum);
    out->lse[i] = lse;
    out->predictions[i] = arg;
    if (ignored[i]) continue;

    const int64_t t = targets[i];
    const double nll = -cw[t] * (z[t] - lse);
    double smooth = 0;
    for (int64_t j = 0; j < v; ++j) smooth -= cw[j] * (z[j] - lse);
    smooth /= static_cast<double>(v);
    // Token scaling: s = p_t, exact here (backends round it to the input dtype).
    const double s = o.token_scaling ? std::exp(z[t] - lse) : 1.0;
    const double ce = s * ((1 - eps) * nll + eps * smooth);
    const double zl = s * zs * lse * lse;
    if (none) {
      out->loss[i] = ce + zl;
      out->z_loss[i] = zl;
    } else {
      ce_total += ce;
      z_total += zl;
    }
    if (arg == t) ++correct;

    double sc = ce_scale, sz = z_scale;
    if (none) sc = sz = p.grad_output != nullptr ? p.grad_output[i] : 1.0;
    sc *= s;
    sz *= s;
    // dL/dz_ij, then through the softcap's tanh.
    for (int64_t j = 0; j < v; ++j) {
      const double pj = std::exp(z[j] - lse);
      const double hot = j == t ? 1.0 : 0.0;
      double gj = sc * ((1 - eps) * cw[t] * (pj - hot) +
                        (eps / static_cast<double>(v)) * (cw_sum * pj - cw[j])) +
                  sz * 2 * zs * lse * pj;
      g[j] = gj * dcap[j];
    }
    // dX_i = g W, dW += g^T x_i, db += g.
    double* dxi = &out->dx[i * h];
    for (int64_t j = 0; j < v; ++j) {
      const double gj = g[j];
      const double* wj = &w[j * h];
      double* dwj = &out->dw[j * h];
      for (int64_t k = 0; k < h; ++k) {
        dxi[k] += gj * wj[k];
        dwj[k] += gj * x[k];
      }
    }
    if (p.bias != nullptr) {
      for (int64_t j = 0; j < v; ++j) out->db[j] += g[j];
    }
  }

  if (!none) {
    double ce_loss = ce_total, z_loss = z_total;
    if (o.reduction == Reduction::kMean) {
      ce_loss = weight_sum != 0 ? ce_total / weight_sum : 0.0;
      z_loss = tokens != 0 ? z_total / static_cast<double>(tokens) : 0.0;
    }
    out->loss[0] = ce_loss + z_loss;
    out->z_loss[0] = z_loss;
  }
  out->accuracy = tokens != 0 ? static_cast<double>(correct) / static_cast<double>(tokens) : 0.0;
  return absl::OkStatus();
}

}  // namespace lossd
