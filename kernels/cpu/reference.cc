// SPDX-License-Identifier: Apache-2.0
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
namespace {

// What every row reads: W widened, the class weights, the targets, and the denominators of
// mean reduction (needed before any gradient row, so one pass over the targets comes first).
struct ReferenceInputs {
  std::vector<double> w;         // (V, H) row-major, widened once (the size of dW itself)
  std::vector<double> cw;        // (V) class weights, 1 without them
  double cw_sum = 0;             // S in the smoothing gradient
  std::vector<int64_t> targets;  // (BT)
  std::vector<bool> ignored;     // (BT) target == ignore_index
  int64_t tokens = 0;            // non-ignored rows
  double weight_sum = 0;         // class-weight sum of the non-ignored targets
};

ReferenceInputs ReadInputs(const LossProblem& p) {
  const int64_t bt = p.bt, h = p.h, v = p.v;
  ReferenceInputs in;
  in.w.resize(static_cast<size_t>(v * h));
  for (int64_t k = 0; k < v * h; ++k) in.w[k] = LoadAsFloat(p.w, p.dtype, k);
  in.cw.assign(v, 1.0);
  if (p.class_weights != nullptr) {
    for (int64_t j = 0; j < v; ++j) in.cw[j] = p.class_weights[j];
  }
  for (int64_t j = 0; j < v; ++j) in.cw_sum += in.cw[j];

  in.targets.resize(bt);
  in.ignored.resize(bt);
  for (int64_t i = 0; i < bt; ++i) {
    const int64_t t = LoadAsInt(p.targets, p.target_dtype, i);
    in.targets[i] = t;
    in.ignored[i] = (t == p.options.ignore_index);
    if (in.ignored[i]) continue;
    ++in.tokens;
    in.weight_sum += in.cw[t];
  }
  return in;
}

// Row i's final logits z = softcap(x W^T + b), and the softcap's derivative dcap where it is
// on (dcap stays 1 without it). Reads row i of X into x.
void RowLogits(const LossProblem& p, const ReferenceInputs& in, int64_t i,
               std::vector<double>* x,     // (H) row i of X, widened
               std::vector<double>* z,     // (V)
               std::vector<double>* dcap) {  // (V)
  const int64_t h = p.h, v = p.v;
  const double cap = p.options.softcap;
  for (int64_t k = 0; k < h; ++k) (*x)[k] = LoadAsFloat(p.x, p.dtype, i * h + k);
  for (int64_t j = 0; j < v; ++j) {
    double acc = p.bias != nullptr ? LoadAsFloat(p.bias, p.dtype, j) : 0.0;
    const double* wj = &in.w[j * h];
    for (int64_t k = 0; k < h; ++k) acc += (*x)[k] * wj[k];
    if (cap > 0) {
      const double th = std::tanh(acc / cap);
      acc = cap * th;
      (*dcap)[j] = 1.0 - th * th;
    }
    (*z)[j] = acc;
  }
}

// The argmax of a row's logits (strict: the first index wins ties) and its log-sum-exp.
void ArgmaxAndLse(const std::vector<double>& z,  // (V)
                  int64_t* arg, double* lse) {
  const int64_t v = static_cast<int64_t>(z.size());
  *arg = 0;
  double zmax = z[0];
  for (int64_t j = 1; j < v; ++j) {
    if (z[j] > zmax) {
      zmax = z[j];
      *arg = j;
    }
  }
  double sum = 0;
  for (int64_t j = 0; j < v; ++j) sum += std::exp(z[j] - zmax);
  *lse = zmax + std::log(sum);
}

// A non-ignored row's loss terms: its token scale s, cross-entropy part and z-loss part.
struct RowLoss {
  double s = 1;   // p_t with token scaling, else 1
  double ce = 0;  // s * ((1 - eps) nll + eps smooth)
  double zl = 0;  // s * zs * lse^2
};

RowLoss RowLossTerms(const LossOptions& o, const ReferenceInputs& in,
                     const std::vector<double>& z,  // (V)
                     double lse, int64_t t) {
  const int64_t v = static_cast<int64_t>(z.size());
  const double eps = o.label_smoothing;
  const double nll = -in.cw[t] * (z[t] - lse);
  double smooth = 0;
  for (int64_t j = 0; j < v; ++j) smooth -= in.cw[j] * (z[j] - lse);
  smooth /= static_cast<double>(v);
  RowLoss r;
  // Token scaling: s = p_t, exact here (backends round it to the input dtype).
  r.s = o.token_scaling ? std::exp(z[t] - lse) : 1.0;
  r.ce = r.s * ((1 - eps) * nll + eps * smooth);
  r.zl = r.s * static_cast<double>(o.z_loss_scale) * lse * lse;
  return r;
}

// dL/dz_ij of a row (sc, sz: its cross-entropy and z-loss gradient scales), then through the
// softcap's tanh.
void RowLogitGradient(const LossOptions& o, const ReferenceInputs& in,
                      const std::vector<double>& z,     // (V)
                      const std::vector<double>& dcap,  // (V)
                      double lse, int64_t t, double sc, double sz,
                      std::vector<double>* g) {  // (V)
  const int64_t v = static_cast<int64_t>(z.size());
  const double eps = o.label_smoothing;
  const double zs = o.z_loss_scale;
  for (int64_t j = 0; j < v; ++j) {
    const double pj = std::exp(z[j] - lse);
    const double hot = j == t ? 1.0 : 0.0;
    double gj = sc * ((1 - eps) * in.cw[t] * (pj - hot) +
                      (eps / static_cast<double>(v)) * (in.cw_sum * pj - in.cw[j])) +
                sz * 2 * zs * lse * pj;
    (*g)[j] = gj * dcap[j];
  }
}

// dX_i = g W, dW += g^T x_i, db += g.
void WriteRowGradients(const LossProblem& p, const ReferenceInputs& in, int64_t i,
                       const std::vector<double>& x,  // (H)
                       const std::vector<double>& g,  // (V)
                       ReferenceOutputs* out) {
  const int64_t h = p.h, v = p.v;
  double* dxi = &out->dx[i * h];
  for (int64_t j = 0; j < v; ++j) {
    const double gj = g[j];
    const double* wj = &in.w[j * h];
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

// Every output zeroed at its size (loss and z_loss per row with reduction none, else one).
void ResetOutputs(const LossProblem& p, int64_t tokens, ReferenceOutputs* out) {
  const int64_t bt = p.bt, h = p.h, v = p.v;
  const bool none = p.options.reduction == Reduction::kNone;
  *out = ReferenceOutputs();
  out->loss.assign(none ? bt : 1, 0.0);
  out->z_loss.assign(none ? bt : 1, 0.0);
  out->lse.assign(bt, 0.0);
  out->predictions.assign(bt, 0);
  out->tokens = tokens;
  out->dx.assign(static_cast<size_t>(bt * h), 0.0);
  out->dw.assign(static_cast<size_t>(v * h), 0.0);
  if (p.bias != nullptr) out->db.assign(v, 0.0);
}

// The row sums of the loss and the correct count, then reduced into `out`.
struct RowTotals {
  double ce = 0, z = 0;
  int64_t correct = 0;
};

void WriteReducedLoss(const LossOptions& o, const ReferenceInputs& in, const RowTotals& totals,
                      ReferenceOutputs* out) {
  const int64_t tokens = in.tokens;
  if (o.reduction != Reduction::kNone) {
    double ce_loss = totals.ce, z_loss = totals.z;
    if (o.reduction == Reduction::kMean) {
      ce_loss = in.weight_sum != 0 ? totals.ce / in.weight_sum : 0.0;
      z_loss = tokens != 0 ? totals.z / static_cast<double>(tokens) : 0.0;
    }
    out->loss[0] = ce_loss + z_loss;
    out->z_loss[0] = z_loss;
  }
  out->accuracy =
      tokens != 0 ? static_cast<double>(totals.correct) / static_cast<double>(tokens) : 0.0;
}

}  // namespace

absl::Status ReferenceCompute(const LossProblem& p, ReferenceOutputs* out) {
  if (out == nullptr) return absl::InvalidArgumentError("reference: out must be non-null");
  // Validated by the caller (core/loss_problem_check.h); debug builds check again.
  LOSSD_DCHECK_VALID_PROBLEM(p, nullptr, "reference");
  // What the reference cannot do, in any problem: it reads W on the host.
  if (p.w_memory != Memory::kHost) {
    return absl::InvalidArgumentError("reference: w_memory must be kHost");
  }

  const LossOptions& o = p.options;
  const bool none = o.reduction == Reduction::kNone;
  const ReferenceInputs in = ReadInputs(p);

  // Gradient scales of the cross-entropy part and of the z-loss part.
  double ce_scale = o.grad_scale, z_scale = o.grad_scale;
  if (o.reduction == Reduction::kMean) {
    ce_scale = in.weight_sum != 0 ? o.grad_scale / in.weight_sum : 0.0;
    z_scale = in.tokens != 0 ? o.grad_scale / static_cast<double>(in.tokens) : 0.0;
  }
  ResetOutputs(p, in.tokens, out);

  std::vector<double> x(p.h), z(p.v), dcap(p.v, 1.0), g(p.v);
  RowTotals totals;
  for (int64_t i = 0; i < p.bt; ++i) {
    RowLogits(p, in, i, &x, &z, &dcap);
    int64_t arg = 0;
    double lse = 0;
    ArgmaxAndLse(z, &arg, &lse);
    out->lse[i] = lse;
    out->predictions[i] = arg;
    if (in.ignored[i]) continue;

    const int64_t t = in.targets[i];
    const RowLoss r = RowLossTerms(o, in, z, lse, t);
    if (none) {
      out->loss[i] = r.ce + r.zl;
      out->z_loss[i] = r.zl;
    } else {
      totals.ce += r.ce;
      totals.z += r.zl;
    }
    if (arg == t) ++totals.correct;

    double sc = ce_scale, sz = z_scale;
    if (none) sc = sz = p.grad_output != nullptr ? p.grad_output[i] : 1.0;
    sc *= r.s;
    sz *= r.s;
    RowLogitGradient(o, in, z, dcap, lse, t, sc, sz, &g);
    WriteRowGradients(p, in, i, x, g, out);
  }
  WriteReducedLoss(o, in, totals, out);
  return absl::OkStatus();
}

}  // namespace lossd
