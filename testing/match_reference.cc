// SPDX-License-Identifier: Apache-2.0
// MatchesReference and the first-order error bounds it compares with (test_util.h): the
// float64 reference against a backend's outputs, each quantity within its own bound.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "gtest/gtest.h"
#include "kernels/cpu/reference.h"
#include "core/dtype.h"
#include "core/loss_problem.h"
#include "testing/row_logits.h"
#include "testing/test_util.h"

namespace lossd {

using test_util_internal::RowLogitCalculator;
using test_util_internal::RowLogits;
using test_util_internal::Softcapped;

namespace {

// The class weights (1 where there are none) and the gradient's scales of the cross-entropy
// and the z-loss terms under the problem's reduction (before a row's grad_output).
struct GradScales {
  std::vector<double> cw;  // (V)
  double cw_sum = 0;
  double ce_scale = 0, z_scale = 0;
};

GradScales GradScalesOf(const LossProblem& p) {
  const LossOptions& o = p.options;
  GradScales g;
  g.cw.assign(p.v, 1.0);
  if (p.class_weights != nullptr) {
    for (int64_t j = 0; j < p.v; ++j) g.cw[j] = p.class_weights[j];
  }
  for (double c : g.cw) g.cw_sum += c;
  int64_t tokens = 0;
  double weight_sum = 0;
  for (int64_t i = 0; i < p.bt; ++i) {
    const int64_t t = LoadAsInt(p.targets, p.target_dtype, i);
    if (t == o.ignore_index) continue;
    ++tokens;
    weight_sum += g.cw[t];
  }
  g.ce_scale = o.grad_scale;
  g.z_scale = o.grad_scale;
  if (o.reduction == Reduction::kMean) {
    g.ce_scale = weight_sum != 0 ? o.grad_scale / weight_sum : 0.0;
    g.z_scale = tokens != 0 ? o.grad_scale / tokens : 0.0;
  }
  return g;
}

}  // namespace

ErrorBounds ComputeErrorBounds(const LossProblem& p, const ReferenceOutputs& ref, double u) {
  const LossOptions& o = p.options;
  const bool none = o.reduction == Reduction::kNone;
  const int64_t v = p.v;
  const double eps = o.label_smoothing, zs = o.z_loss_scale, cap = o.softcap;
  RowLogitCalculator calc(p);
  const GradScales scales = GradScalesOf(p);
  const std::vector<double>& cw = scales.cw;
  const double cw_sum = scales.cw_sum, ce_scale = scales.ce_scale, z_scale = scales.z_scale;

  ErrorBounds b;
  b.ce.assign(p.bt, 0.0);
  b.zl.assign(p.bt, 0.0);
  b.lse.assign(p.bt, 0.0);
  std::vector<double> zraw(v), th(v), dcap(v, 1.0), dzraw(v), dzf(v), pr(v), zfs(v);
  double err2 = 0, g2 = 0;
  for (int64_t i = 0; i < p.bt; ++i) {
    calc.Row(i, &zraw);
    double l = 0;  // bound on |d lse_i| = sum_j p_j |d zf_j|
    for (int64_t j = 0; j < v; ++j) {
      const double acc = zraw[j];
      double zf = acc;
      if (cap > 0) {
        th[j] = std::tanh(acc / cap);
        dcap[j] = 1 - th[j] * th[j];
        zf = cap * th[j];
      }
      zfs[j] = zf;
      dzraw[j] = u * std::fabs(acc);
      dzf[j] = dcap[j] * dzraw[j];
      pr[j] = std::exp(zf - ref.lse[i]);
      l += pr[j] * dzf[j];
    }
    b.lse[i] = l;
    const int64_t t = LoadAsInt(p.targets, p.target_dtype, i);
    if (t == o.ignore_index) continue;
    double smooth = 0;  // bounds: the weights' magnitudes (they may be negative)
    for (int64_t j = 0; j < v; ++j) smooth += std::fabs(cw[j]) * (dzf[j] + l);
    b.ce[i] = (1 - eps) * std::fabs(cw[t]) * (dzf[t] + l) + eps * smooth / v;
    b.zl[i] = 2 * zs * std::fabs(ref.lse[i]) * l;
    // Token scaling: the row's values are s times the unscaled ones (s exact here).
    double s = 1, ds = 0;
    if (o.token_scaling) {
      s = pr[t];
      ds = s * (dzf[t] + l + u + std::ldexp(1.0, -21) * (1 + std::fabs(ref.lse[i])));
      double ce = 0;  // the unscaled cross-entropy, for |ce| ds
      for (int64_t j = 0; j < v && eps > 0; ++j) ce += cw[j] * (ref.lse[i] - zfs[j]);
      ce = (1 - eps) * cw[t] * (ref.lse[i] - zfs[t]) + eps * ce / v;
      b.ce[i] = s * b.ce[i] + std::fabs(ce) * ds;
      b.zl[i] = s * b.zl[i] + zs * ref.lse[i] * ref.lse[i] * ds;
    }
    double sc = ce_scale, sz = z_scale;
    if (none) sc = sz = p.grad_output != nullptr ? p.grad_output[i] : 1.0;
    const double a = sc * ((1 - eps) * cw[t] + eps * cw_sum / v) + 2 * sz * zs * ref.lse[i];
    for (int64_t j = 0; j < v; ++j) {
      const double gz = a * pr[j] - sc * eps / v * cw[j] - (j == t ? sc * (1 - eps) * cw[t] : 0);
      const double g = gz * dcap[j];
      // d p_j = p_j (d zf_j - d lse); d a = 2 sz zs d lse; d(1 - tanh^2) = 2 |tanh| dcap dz / cap;
      // and G itself is stored in the input dtype (u |g|).
      double dg = dcap[j] * (std::fabs(a) * pr[j] * (dzf[j] + l) + 2 * std::fabs(sz) * zs * l * pr[j]);
      if (cap > 0) dg += std::fabs(gz) * 2 * std::fabs(th[j]) * dcap[j] * dzraw[j] / cap;
      dg += u * std::fabs(g);
      dg = s * dg + std::fabs(g) * ds;
      err2 += dg * dg;
      g2 += s * g * s * g;
    }
  }
  b.grad_rel = g2 > 0 ? std::sqrt(err2 / g2) : 0.0;
  return b;
}

namespace {

// What every check of one MatchesReference call reads: the problem, the reference, the
// outputs, the tolerances and bounds, and which rows are ignored.
struct MatchInputs {
  const LossProblem& p;
  const LogitStats& stats;
  const ReferenceOutputs& ref;
  const LossOutputs& got;
  Tolerance tol;
  ErrorBounds eb;
  std::vector<bool> ignored;  // (BT) the row's target is ignore_index
  double weight_sum = 0;      // the class weights of the rows not ignored

  // The fp32 arithmetic's floor under every bound, relative to r and absolute at scale 1.
  double Floor(double r) const { return tol.fp32_rel * (std::fabs(r) + 1); }
};

MatchInputs MatchInputsOf(const LossProblem& p, const LogitStats& stats,
                          const ReferenceOutputs& ref, const LossOutputs& got) {
  const Tolerance tol = ToleranceFor(p.dtype, got.grad_dtype);
  MatchInputs m{p, stats, ref, got, tol, ComputeErrorBounds(p, ref, tol.logit_u),
                std::vector<bool>(p.bt)};
  for (int64_t i = 0; i < p.bt; ++i) {
    const int64_t t = LoadAsInt(p.targets, p.target_dtype, i);
    m.ignored[i] = t == p.options.ignore_index;
    if (!m.ignored[i]) m.weight_sum += p.class_weights != nullptr ? p.class_weights[t] : 1.0;
  }
  return m;
}

// loss and z_loss, per row (reduction none) or as the reduced sum or mean.
void CheckLosses(const MatchInputs& m, std::vector<CompareResult>* results) {
  const LossProblem& p = m.p;
  const ReferenceOutputs& ref = m.ref;
  const ErrorBounds& eb = m.eb;
  const LossOptions& o = p.options;
  if (m.got.loss == nullptr && m.got.z_loss == nullptr) return;
  std::vector<double> loss_b, zl_b;
  if (o.reduction == Reduction::kNone) {
    for (int64_t i = 0; i < p.bt; ++i) {
      loss_b.push_back(eb.ce[i] + eb.zl[i] + m.Floor(ref.loss[i]));
      zl_b.push_back(eb.zl[i] + m.Floor(ref.z_loss[i]));
    }
  } else {
    // Rows' errors come from independent roundings of different logits: their sum grows
    // like the root of the sum of squares; 4 times that (about 7 sigma for errors uniform
    // within their bounds).
    double ce2 = 0, z2 = 0;
    for (int64_t i = 0; i < p.bt; ++i) {
      ce2 += eb.ce[i] * eb.ce[i];
      z2 += eb.zl[i] * eb.zl[i];
    }
    double ce_div = 1, z_div = 1;
    if (o.reduction == Reduction::kMean) {
      ce_div = m.weight_sum != 0 ? std::fabs(m.weight_sum) : 1;
      z_div = ref.tokens > 0 ? static_cast<double>(ref.tokens) : 1;
    }
    const double ce_b = 4 * std::sqrt(ce2) / ce_div, z_b = 4 * std::sqrt(z2) / z_div;
    loss_b.push_back(ce_b + z_b + m.Floor(ref.loss[0]));
    zl_b.push_back(z_b + m.Floor(ref.z_loss[0]));
  }
  if (m.got.loss != nullptr) {
    results->push_back(CompareElementwise(
        "loss", ref.loss, Widen(m.got.loss, DType::kF32, ref.loss.size()), loss_b));
  }
  if (m.got.z_loss != nullptr) {
    results->push_back(CompareElementwise(
        "z_loss", ref.z_loss, Widen(m.got.z_loss, DType::kF32, ref.z_loss.size()), zl_b));
  }
}

// predictions: each the reference's argmax, or another within rounding of it (counted in
// *flips, which the accuracy's bound allows for).
CompareResult CheckPredictions(const MatchInputs& m, int64_t* flips) {
  const LossProblem& p = m.p;
  CompareResult r;
  r.name = "predictions";
  r.count = p.bt;
  std::vector<double> z;
  for (int64_t i = 0; i < p.bt; ++i) {
    const int64_t g = m.got.predictions[i];
    const int64_t want = m.ref.predictions[i];
    if (g == want) continue;
    bool accepted = false;
    if (g >= 0 && g < p.v) {
      // Another argmax is right when the two logits are within their rounding of each other.
      RowLogits(p, i, &z);
      const double cap = p.options.softcap;
      const double gap = Softcapped(z[want], cap) - Softcapped(z[g], cap);
      accepted = gap <= m.tol.logit_u * (std::fabs(z[want]) + std::fabs(z[g])) +
                            m.tol.fp32_rel * m.stats.row_abs_max[i];
    }
    if (accepted) {
      ++*flips;
    } else {
      ++r.mismatches;
      if (r.worst_index < 0) r.worst_index = i;
    }
  }
  return r;
}

// accuracy: the reference's within the accepted flips, and the share of the outputs' own
// predictions that hit their targets.
void CheckAccuracy(const MatchInputs& m, int64_t flips, std::vector<CompareResult>* results) {
  const LossProblem& p = m.p;
  const ReferenceOutputs& ref = m.ref;
  const double tokens = static_cast<double>(std::max<int64_t>(ref.tokens, 1));
  std::vector<double> b = {flips / tokens + 1e-6};
  results->push_back(CompareElementwise("accuracy", {ref.accuracy},
                                        {static_cast<double>(*m.got.accuracy)}, b));
  if (m.got.predictions == nullptr) return;
  int64_t correct = 0;
  for (int64_t i = 0; i < p.bt; ++i) {
    if (!m.ignored[i] && m.got.predictions[i] == LoadAsInt(p.targets, p.target_dtype, i)) {
      ++correct;
    }
  }
  const double own = ref.tokens > 0 ? correct / static_cast<double>(ref.tokens) : 0.0;
  results->push_back(CompareElementwise("accuracy vs own predictions", {own},
                                        {static_cast<double>(*m.got.accuracy)}, {1e-6}));
}

// dx (and its ignored rows exactly 0), dw or dw_accum, db or db_accum.
void CheckGradients(const MatchInputs& m, std::vector<CompareResult>* results) {
  const LossProblem& p = m.p;
  const ReferenceOutputs& ref = m.ref;
  const LossOutputs& got = m.got;
  const Tolerance& tol = m.tol;
  // G's first-order relative error, twice (the GEMMs with random X and W carry a relative
  // error over about unchanged), plus the output rounding and fp32 arithmetic.
  // The GEMMs' own fp32 rounding: independent roundings over K terms grow like
  // sqrt(K) 2^-24 (K = V for dX, BT for dW and db); 4x margin.
  const double gemm_rel =
      4 * std::sqrt(static_cast<double>(std::max(p.v, p.bt))) * std::ldexp(1.0, -24);
  const double grad_tol = 2 * m.eb.grad_rel + tol.grad_u + tol.fp32_rel + gemm_rel;
  if (got.dx != nullptr) {
    std::vector<double> dx = Widen(got.dx, got.grad_dtype, p.bt * p.h);
    results->push_back(CompareRelNorm("dx", ref.dx, dx, grad_tol));
    CompareResult r;
    r.name = "dx rows of ignored targets (must be exactly 0)";
    r.count = p.bt * p.h;
    for (int64_t i = 0; i < p.bt; ++i) {
      if (!m.ignored[i]) continue;
      for (int64_t k = 0; k < p.h; ++k) {
        if (dx[i * p.h + k] != 0) {
          ++r.mismatches;
          if (r.worst_index < 0) r.worst_index = i * p.h + k;
        }
      }
    }
    results->push_back(r);
  }
  if (got.dw_accum != nullptr) {
    results->push_back(CompareRelNorm("dw_accum", ref.dw,
                                      Widen(got.dw_accum, DType::kF32, p.v * p.h),
                                      grad_tol - tol.grad_u + tol.fp32_rel));
  } else if (got.dw != nullptr) {
    results->push_back(
        CompareRelNorm("dw", ref.dw, Widen(got.dw, got.grad_dtype, p.v * p.h), grad_tol));
  }
  if (p.bias != nullptr) {
    if (got.db_accum != nullptr) {
      results->push_back(CompareRelNorm("db_accum", ref.db,
                                        Widen(got.db_accum, DType::kF32, p.v),
                                        grad_tol - tol.grad_u + tol.fp32_rel));
    } else if (got.db != nullptr) {
      results->push_back(
          CompareRelNorm("db", ref.db, Widen(got.db, got.grad_dtype, p.v), grad_tol));
    }
  }
}

// The problem's line, then every check ok or FAIL; a failure where any check failed.
::testing::AssertionResult Report(const MatchInputs& m,
                                  const std::vector<CompareResult>& results) {
  const LossProblem& p = m.p;
  const LossOptions& o = p.options;
  bool ok = true;
  std::string report;
  for (const CompareResult& r : results) {
    if (!r.ok()) {
      ok = false;
      absl::StrAppend(&report, "\n  FAIL ", r.ToString());
    } else {
      absl::StrAppend(&report, "\n  ok   ", r.ToString());
    }
  }
  const std::string head = absl::StrFormat(
      "bt=%d h=%d v=%d dtype=%s grad=%s reduction=%d eps=%g zs=%g cap=%g bias=%d cw=%d "
      "logit |z| max %.3g, rms row max %.3g, G rel error bound %.3g",
      p.bt, p.h, p.v, DTypeName(p.dtype), DTypeName(m.got.grad_dtype),
      static_cast<int>(o.reduction), o.label_smoothing, o.z_loss_scale, o.softcap,
      p.bias != nullptr, p.class_weights != nullptr, m.stats.abs_max, m.stats.rms_row_abs_max,
      m.eb.grad_rel);
  if (ok) return ::testing::AssertionSuccess() << head << report;
  return ::testing::AssertionFailure() << head << report;
}

}  // namespace

::testing::AssertionResult MatchesReference(const LossProblem& p, const LogitStats& stats,
                                            const ReferenceOutputs& ref,
                                            const LossOutputs& got) {
  const MatchInputs m = MatchInputsOf(p, stats, ref, got);
  std::vector<CompareResult> results;
  CheckLosses(m, &results);
  if (got.lse != nullptr) {
    std::vector<double> b(p.bt);
    for (int64_t i = 0; i < p.bt; ++i) b[i] = m.eb.lse[i] + m.Floor(ref.lse[i]);
    results.push_back(CompareElementwise("lse", ref.lse, Widen(got.lse, DType::kF32, p.bt), b));
  }
  int64_t flips = 0;
  if (got.predictions != nullptr) results.push_back(CheckPredictions(m, &flips));
  if (got.tokens != nullptr) {
    CompareResult r;
    r.name = absl::StrCat("tokens (got ", *got.tokens, ", want ", ref.tokens, ")");
    r.count = 1;
    r.mismatches = *got.tokens == ref.tokens ? 0 : 1;
    results.push_back(r);
  }
  if (got.accuracy != nullptr) CheckAccuracy(m, flips, &results);
  CheckGradients(m, &results);
  return Report(m, results);
}

}  // namespace lossd
