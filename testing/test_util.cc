#include "testing/test_util.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "kernels/cpu/reference.h"
#include "core/dtype.h"
#include "core/loss_problem.h"
#include "core/loss_problem_check.h"

namespace lossd {
namespace {

std::vector<uint8_t> StoreAll(const std::vector<float>& v, DType t) {
  std::vector<uint8_t> out(v.size() * DTypeSize(t));
  for (size_t i = 0; i < v.size(); ++i) StoreFromFloat(out.data(), t, i, v[i]);
  return out;
}

// Raw logits (x_i W^T + b) in double from the stored inputs, with W and b widened once.
class RowLogitCalculator {
 public:
  explicit RowLogitCalculator(const LossProblem& p)
      : p_(p), w_(Widen(p.w, p.dtype, p.v * p.h)), x_(p.h) {
    bias_ = p.bias != nullptr ? Widen(p.bias, p.dtype, p.v) : std::vector<double>(p.v, 0.0);
  }
  // (V) logits of row i.
  void Row(int64_t i, std::vector<double>* z) {
    for (int64_t k = 0; k < p_.h; ++k) x_[k] = LoadAsFloat(p_.x, p_.dtype, i * p_.h + k);
    z->resize(p_.v);
    for (int64_t j = 0; j < p_.v; ++j) {
      // Four partial sums: faster, and no less exact in double at these sizes.
      const double* wj = &w_[j * p_.h];
      double a[4] = {0, 0, 0, 0};
      int64_t k = 0;
      for (; k + 4 <= p_.h; k += 4) {
        for (int l = 0; l < 4; ++l) a[l] += x_[k + l] * wj[k + l];
      }
      for (; k < p_.h; ++k) a[0] += x_[k] * wj[k];
      (*z)[j] = bias_[j] + ((a[0] + a[1]) + (a[2] + a[3]));
    }
  }

 private:
  const LossProblem& p_;
  std::vector<double> w_, bias_, x_;
};

void RowLogits(const LossProblem& p, int64_t i, std::vector<double>* z) {
  RowLogitCalculator(p).Row(i, z);
}

double Softcapped(double z, double cap) { return cap > 0 ? cap * std::tanh(z / cap) : z; }

}  // namespace

LogitStats ComputeLogitStats(const LossProblem& p) {
  LogitStats s;
  s.row_abs_max.assign(p.bt, 0.0);
  std::vector<double> z;
  double sq = 0;
  RowLogitCalculator calc(p);
  for (int64_t i = 0; i < p.bt; ++i) {
    calc.Row(i, &z);
    double m = 0;
    for (double e : z) m = std::max(m, std::fabs(e));
    s.row_abs_max[i] = m;
    sq += m * m;
    s.abs_max = std::max(s.abs_max, m);
  }
  s.rms_row_abs_max = p.bt > 0 ? std::sqrt(sq / p.bt) : 0.0;
  return s;
}

RandomProblemSpec SpecOf(int64_t bt, int64_t h, int64_t v, DType dtype, const OptionCase& c,
                         float grad_scale, uint64_t seed) {
  RandomProblemSpec spec;
  spec.bt = bt;
  spec.h = h;
  spec.v = v;
  spec.dtype = dtype;
  spec.target_dtype = c.target_dtype;
  spec.options.reduction = c.reduction;
  spec.options.label_smoothing = c.eps;
  spec.options.z_loss_scale = c.zs;
  spec.options.softcap = c.cap;
  spec.options.chunk_rows = c.chunk_rows;
  spec.options.grad_scale = grad_scale;
  spec.bias = c.bias;
  spec.class_weights = c.weights;
  spec.class_weight_scale = c.weight_scale;
  spec.signed_class_weights = c.signed_weights;
  spec.options.token_scaling = c.token_scaling;
  spec.grad_output = c.grad_output;
  spec.ignore_fraction = c.ignore;
  spec.seed = seed;
  return spec;
}

RandomProblem RandomProblem::Make(const RandomProblemSpec& spec) {
  RandomProblem r;
  r.spec_ = spec;
  std::mt19937_64 rng(spec.seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  const float w_std = static_cast<float>(spec.logit_scale / std::sqrt(static_cast<double>(spec.h)));
  std::vector<float> x(spec.bt * spec.h), w(spec.v * spec.h);
  for (float& e : x) e = normal(rng);
  for (float& e : w) e = w_std * normal(rng);
  r.x = StoreAll(x, spec.dtype);
  r.w = StoreAll(w, spec.dtype);
  if (spec.bias) {
    std::vector<float> b(spec.v);
    for (float& e : b) e = 0.5f * normal(rng);
    r.bias = StoreAll(b, spec.dtype);
  }
  if (spec.class_weights) {
    r.class_weights.resize(spec.v);
    const float scale = static_cast<float>(spec.class_weight_scale);
    const float lo = spec.signed_class_weights ? -1.0f : 0.25f;
    for (float& e : r.class_weights) e = scale * (lo + (2.0f - lo) * unit(rng));
  }
  if (spec.grad_output) {
    r.grad_output.resize(spec.bt);
    for (float& e : r.grad_output) e = 4.0f * unit(rng) - 2.0f;
  }
  // Targets: some ignored, some the row's argmax (so accuracy is not trivially 0), one V-1,
  // the rest uniform.
  r.targets.assign(spec.bt, 0);
  std::uniform_int_distribution<int64_t> any(0, spec.v - 1);
  for (int64_t& t : r.targets) t = any(rng);
  r.targets32_.assign(spec.bt, 0);
  const LossProblem view = r.problem();
  RowLogitCalculator calc(view);
  std::vector<double> z;
  for (int64_t i = 0; i < spec.bt; ++i) {
    const float u = unit(rng);
    if (u < spec.ignore_fraction) {
      r.targets[i] = spec.options.ignore_index;
    } else if (u < spec.ignore_fraction + (1 - spec.ignore_fraction) * spec.argmax_fraction) {
      calc.Row(i, &z);
      int64_t arg = 0;
      for (int64_t j = 1; j < spec.v; ++j) {
        if (Softcapped(z[j], spec.options.softcap) > Softcapped(z[arg], spec.options.softcap)) {
          arg = j;
        }
      }
      r.targets[i] = arg;
    }
  }
  if (spec.bt > 1 && r.targets[spec.bt / 2] != spec.options.ignore_index) {
    r.targets[spec.bt / 2] = spec.v - 1;
  }
  r.RecomputeStats();
  return r;
}

LossProblem RandomProblem::problem() const {
  LossProblem p;
  p.bt = spec_.bt;
  p.h = spec_.h;
  p.v = spec_.v;
  p.dtype = spec_.dtype;
  p.x = x.data();
  p.w = w.data();
  p.bias = bias.empty() ? nullptr : bias.data();
  p.target_dtype = spec_.target_dtype;
  if (spec_.target_dtype == DType::kI32) {
    targets32_.assign(targets.begin(), targets.end());
    p.targets = targets32_.data();
  } else {
    p.targets = targets.data();
  }
  p.class_weights = class_weights.empty() ? nullptr : class_weights.data();
  p.grad_output = grad_output.empty() ? nullptr : grad_output.data();
  p.options = spec_.options;
  return p;
}

HostOutputs::HostOutputs(const LossProblem& p, DType grad_dtype_in, bool want_grads,
                         bool accumulate_in)
    : grad_dtype(grad_dtype_in), accumulate(accumulate_in) {
  const bool none = p.options.reduction == Reduction::kNone;
  loss.resize(none ? p.bt : 1);
  z_loss.resize(none ? p.bt : 1);
  lse.resize(p.bt);
  predictions.resize(p.bt);
  if (want_grads) {
    dx.resize(p.bt * p.h * DTypeSize(grad_dtype));
    if (accumulate) {
      dw_accum.assign(p.v * p.h, 0.0f);
      if (p.bias != nullptr) db_accum.assign(p.v, 0.0f);
    } else {
      dw.resize(p.v * p.h * DTypeSize(grad_dtype));
      if (p.bias != nullptr) db.resize(p.v * DTypeSize(grad_dtype));
    }
  }
  Poison();
}

void HostOutputs::Poison() {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::fill(loss.begin(), loss.end(), nan);
  std::fill(z_loss.begin(), z_loss.end(), nan);
  std::fill(lse.begin(), lse.end(), nan);
  std::fill(predictions.begin(), predictions.end(), int64_t{-1});
  accuracy = nan;
  tokens = -1;
  // 0xFF bytes are a NaN in bf16, fp16 and fp32 alike.
  std::fill(dx.begin(), dx.end(), 0xFF);
  std::fill(dw.begin(), dw.end(), 0xFF);
  std::fill(db.begin(), db.end(), 0xFF);
}

LossOutputs HostOutputs::outputs() {
  LossOutputs o;
  o.grad_dtype = grad_dtype;
  o.loss = loss.data();
  o.z_loss = z_loss.data();
  o.lse = lse.data();
  o.predictions = predictions.data();
  o.accuracy = &accuracy;
  o.tokens = &tokens;
  o.dx = dx.empty() ? nullptr : dx.data();
  o.dw = dw.empty() ? nullptr : dw.data();
  o.db = db.empty() ? nullptr : db.data();
  o.dw_accum = dw_accum.empty() ? nullptr : dw_accum.data();
  o.db_accum = db_accum.empty() ? nullptr : db_accum.data();
  o.accum_memory = Memory::kHost;
  return o;
}

Tolerance ToleranceFor(DType input, DType grad) {
  auto unit_roundoff = [](DType t) {
    switch (t) {
      case DType::kBF16:
        return std::ldexp(1.0, -8);  // 8 significant bits
      case DType::kF16:
        return std::ldexp(1.0, -11);  // 11 significant bits
      default:
        return std::ldexp(1.0, -24);  // fp32
    }
  };
  Tolerance t;
  t.logit_u = unit_roundoff(input);
  t.grad_u = unit_roundoff(grad);
  // fp32 sums of up to a few thousand terms in the row pass and the GEMMs (blocked, so the
  // error grows far slower than n * 2^-24), and fp32 exp/log.
  t.fp32_rel = 1e-5;
  return t;
}

std::string CompareResult::ToString() const {
  return absl::StrFormat(
      "%s: %d of %d elements mismatch; worst index %d; max abs err %.3g, max rel err %.3g, "
      "rel norm err %.3g, tolerance %.3g",
      name, mismatches, count, worst_index, max_abs, max_rel, rel_norm, tolerance);
}

CompareResult CompareElementwise(const std::string& name, const std::vector<double>& ref,
                                 const std::vector<double>& got,
                                 const std::vector<double>& bound) {
  CompareResult r;
  r.name = name;
  r.count = static_cast<int64_t>(ref.size());
  if (got.size() != ref.size() || bound.size() != ref.size()) {
    r.mismatches = r.count + 1;
    r.name += absl::StrCat(" (size ", got.size(), " vs reference ", ref.size(), ")");
    return r;
  }
  double worst_ratio = -1;
  for (size_t k = 0; k < ref.size(); ++k) {
    const double err = std::fabs(got[k] - ref[k]);
    const bool bad = !(err <= bound[k]);  // NaN is bad
    const double ratio = std::isnan(err) ? std::numeric_limits<double>::infinity()
                                         : err / std::max(bound[k], 1e-300);
    if (bad) ++r.mismatches;
    if (ratio > worst_ratio) {
      worst_ratio = ratio;
      r.worst_index = static_cast<int64_t>(k);
      r.tolerance = bound[k];
    }
    if (!(err <= r.max_abs)) r.max_abs = err;
    if (ref[k] != 0) r.max_rel = std::max(r.max_rel, err / std::fabs(ref[k]));
  }
  return r;
}

CompareResult CompareRelNorm(const std::string& name, const std::vector<double>& ref,
                             const std::vector<double>& got, double tol) {
  CompareResult r;
  r.name = name;
  r.count = static_cast<int64_t>(ref.size());
  r.tolerance = tol;
  if (got.size() != ref.size()) {
    r.mismatches = r.count + 1;
    r.name += absl::StrCat(" (size ", got.size(), " vs reference ", ref.size(), ")");
    return r;
  }
  double err2 = 0, ref2 = 0, worst = -1;
  int64_t non_finite = 0;
  for (size_t k = 0; k < ref.size(); ++k) {
    const double err = std::fabs(got[k] - ref[k]);
    if (!std::isfinite(got[k])) ++non_finite;
    err2 += err * err;
    ref2 += ref[k] * ref[k];
    if (!(err <= worst)) {
      worst = err;
      r.worst_index = static_cast<int64_t>(k);
    }
    if (!(err <= r.max_abs)) r.max_abs = err;
    if (ref[k] != 0) r.max_rel = std::max(r.max_rel, err / std::fabs(ref[k]));
  }
  r.rel_norm = ref2 > 0 ? std::sqrt(err2 / ref2) : (err2 == 0 ? 0.0 : std::numeric_limits<double>::infinity());
  // Count the elements whose error share exceeds their share of the allowed norm, so a
  // failure says how widespread it is.
  const double allowed = tol * std::sqrt(ref2);
  if (non_finite > 0 || !(r.rel_norm <= tol)) {
    for (size_t k = 0; k < ref.size(); ++k) {
      const double err = std::fabs(got[k] - ref[k]);
      if (!(err <= allowed / std::sqrt(static_cast<double>(ref.size())) + tol * std::fabs(ref[k]))) {
        ++r.mismatches;
      }
    }
    if (r.mismatches == 0) r.mismatches = 1;
  }
  return r;
}

std::vector<double> Widen(const void* data, DType t, size_t n) {
  std::vector<double> out(n);
  for (size_t k = 0; k < n; ++k) out[k] = LoadAsFloat(data, t, k);
  return out;
}

ErrorBounds ComputeErrorBounds(const LossProblem& p, const ReferenceOutputs& ref, double u) {
  const LossOptions& o = p.options;
  const bool none = o.reduction == Reduction::kNone;
  const int64_t v = p.v;
  const double eps = o.label_smoothing, zs = o.z_loss_scale, cap = o.softcap;
  std::vector<double> cw(p.v, 1.0);
  RowLogitCalculator calc(p);
  if (p.class_weights != nullptr) {
    for (int64_t j = 0; j < v; ++j) cw[j] = p.class_weights[j];
  }
  double cw_sum = 0;
  for (double c : cw) cw_sum += c;
  int64_t tokens = 0;
  double weight_sum = 0;
  for (int64_t i = 0; i < p.bt; ++i) {
    const int64_t t = LoadAsInt(p.targets, p.target_dtype, i);
    if (t == o.ignore_index) continue;
    ++tokens;
    weight_sum += cw[t];
  }
  double ce_scale = o.grad_scale, z_scale = o.grad_scale;
  if (o.reduction == Reduction::kMean) {
    ce_scale = weight_sum != 0 ? o.grad_scale / weight_sum : 0.0;
    z_scale = tokens != 0 ? o.grad_scale / tokens : 0.0;
  }

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

::testing::AssertionResult MatchesReference(const LossProblem& p, const LogitStats& stats,
                                            const ReferenceOutputs& ref,
                                            const LossOutputs& got) {
  const Tolerance tol = ToleranceFor(p.dtype, got.grad_dtype);
  const LossOptions& o = p.options;
  const bool none = o.reduction == Reduction::kNone;
  const ErrorBounds eb = ComputeErrorBounds(p, ref, tol.logit_u);
  std::vector<bool> ignored(p.bt);
  double weight_sum = 0;
  for (int64_t i = 0; i < p.bt; ++i) {
    const int64_t t = LoadAsInt(p.targets, p.target_dtype, i);
    ignored[i] = t == o.ignore_index;
    if (!ignored[i]) weight_sum += p.class_weights != nullptr ? p.class_weights[t] : 1.0;
  }
  std::vector<CompareResult> results;
  auto floor = [&](double r) { return tol.fp32_rel * (std::fabs(r) + 1); };

  if (got.loss != nullptr || got.z_loss != nullptr) {
    std::vector<double> loss_b, zl_b;
    if (none) {
      for (int64_t i = 0; i < p.bt; ++i) {
        loss_b.push_back(eb.ce[i] + eb.zl[i] + floor(ref.loss[i]));
        zl_b.push_back(eb.zl[i] + floor(ref.z_loss[i]));
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
        ce_div = weight_sum != 0 ? std::fabs(weight_sum) : 1;
        z_div = ref.tokens > 0 ? static_cast<double>(ref.tokens) : 1;
      }
      const double ce_b = 4 * std::sqrt(ce2) / ce_div, z_b = 4 * std::sqrt(z2) / z_div;
      loss_b.push_back(ce_b + z_b + floor(ref.loss[0]));
      zl_b.push_back(z_b + floor(ref.z_loss[0]));
    }
    if (got.loss != nullptr) {
      results.push_back(CompareElementwise(
          "loss", ref.loss, Widen(got.loss, DType::kF32, ref.loss.size()), loss_b));
    }
    if (got.z_loss != nullptr) {
      results.push_back(CompareElementwise(
          "z_loss", ref.z_loss, Widen(got.z_loss, DType::kF32, ref.z_loss.size()), zl_b));
    }
  }
  if (got.lse != nullptr) {
    std::vector<double> b(p.bt);
    for (int64_t i = 0; i < p.bt; ++i) b[i] = eb.lse[i] + floor(ref.lse[i]);
    results.push_back(CompareElementwise("lse", ref.lse, Widen(got.lse, DType::kF32, p.bt), b));
  }
  int64_t flips = 0;
  if (got.predictions != nullptr) {
    CompareResult r;
    r.name = "predictions";
    r.count = p.bt;
    std::vector<double> z;
    for (int64_t i = 0; i < p.bt; ++i) {
      const int64_t g = got.predictions[i];
      const int64_t want = ref.predictions[i];
      if (g == want) continue;
      bool accepted = false;
      if (g >= 0 && g < p.v) {
        // Another argmax is right when the two logits are within their rounding of each other.
        RowLogits(p, i, &z);
        const double gap = Softcapped(z[want], o.softcap) - Softcapped(z[g], o.softcap);
        accepted = gap <= tol.logit_u * (std::fabs(z[want]) + std::fabs(z[g])) +
                              tol.fp32_rel * stats.row_abs_max[i];
      }
      if (accepted) {
        ++flips;
      } else {
        ++r.mismatches;
        if (r.worst_index < 0) r.worst_index = i;
      }
    }
    results.push_back(r);
  }
  if (got.tokens != nullptr) {
    CompareResult r;
    r.name = absl::StrCat("tokens (got ", *got.tokens, ", want ", ref.tokens, ")");
    r.count = 1;
    r.mismatches = *got.tokens == ref.tokens ? 0 : 1;
    results.push_back(r);
  }
  if (got.accuracy != nullptr) {
    const double tokens = static_cast<double>(std::max<int64_t>(ref.tokens, 1));
    std::vector<double> b = {flips / tokens + 1e-6};
    results.push_back(CompareElementwise("accuracy", {ref.accuracy},
                                         {static_cast<double>(*got.accuracy)}, b));
    if (got.predictions != nullptr) {
      int64_t correct = 0;
      for (int64_t i = 0; i < p.bt; ++i) {
        if (!ignored[i] && got.predictions[i] == LoadAsInt(p.targets, p.target_dtype, i)) {
          ++correct;
        }
      }
      const double own = ref.tokens > 0 ? correct / static_cast<double>(ref.tokens) : 0.0;
      results.push_back(CompareElementwise("accuracy vs own predictions", {own},
                                           {static_cast<double>(*got.accuracy)}, {1e-6}));
    }
  }
  // G's first-order relative error, twice (the GEMMs with random X and W carry a relative
  // error over about unchanged), plus the output rounding and fp32 arithmetic.
  // The GEMMs' own fp32 rounding: independent roundings over K terms grow like
  // sqrt(K) 2^-24 (K = V for dX, BT for dW and db); 4x margin.
  const double gemm_rel =
      4 * std::sqrt(static_cast<double>(std::max(p.v, p.bt))) * std::ldexp(1.0, -24);
  const double grad_tol = 2 * eb.grad_rel + tol.grad_u + tol.fp32_rel + gemm_rel;
  if (got.dx != nullptr) {
    std::vector<double> dx = Widen(got.dx, got.grad_dtype, p.bt * p.h);
    results.push_back(CompareRelNorm("dx", ref.dx, dx, grad_tol));
    CompareResult r;
    r.name = "dx rows of ignored targets (must be exactly 0)";
    r.count = p.bt * p.h;
    for (int64_t i = 0; i < p.bt; ++i) {
      if (!ignored[i]) continue;
      for (int64_t k = 0; k < p.h; ++k) {
        if (dx[i * p.h + k] != 0) {
          ++r.mismatches;
          if (r.worst_index < 0) r.worst_index = i * p.h + k;
        }
      }
    }
    results.push_back(r);
  }
  if (got.dw_accum != nullptr) {
    results.push_back(CompareRelNorm("dw_accum", ref.dw,
                                     Widen(got.dw_accum, DType::kF32, p.v * p.h),
                                     grad_tol - tol.grad_u + tol.fp32_rel));
  } else if (got.dw != nullptr) {
    results.push_back(
        CompareRelNorm("dw", ref.dw, Widen(got.dw, got.grad_dtype, p.v * p.h), grad_tol));
  }
  if (p.bias != nullptr) {
    if (got.db_accum != nullptr) {
      results.push_back(CompareRelNorm("db_accum", ref.db, Widen(got.db_accum, DType::kF32, p.v),
                                       grad_tol - tol.grad_u + tol.fp32_rel));
    } else if (got.db != nullptr) {
      results.push_back(
          CompareRelNorm("db", ref.db, Widen(got.db, got.grad_dtype, p.v), grad_tol));
    }
  }

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
      p.bt, p.h, p.v, DTypeName(p.dtype), DTypeName(got.grad_dtype),
      static_cast<int>(o.reduction), o.label_smoothing, o.z_loss_scale, o.softcap,
      p.bias != nullptr, p.class_weights != nullptr, stats.abs_max, stats.rms_row_abs_max,
      eb.grad_rel);
  if (ok) return ::testing::AssertionSuccess() << head << report;
  return ::testing::AssertionFailure() << head << report;
}

::testing::AssertionResult BitIdentical(const HostOutputs& a, const HostOutputs& b) {
  std::string diffs;
  auto check = [&](const char* name, const void* pa, size_t na, const void* pb, size_t nb) {
    if (na != nb) {
      absl::StrAppend(&diffs, " ", name, ": ", na, " vs ", nb, " bytes;");
      return;
    }
    const uint8_t* ua = static_cast<const uint8_t*>(pa);
    const uint8_t* ub = static_cast<const uint8_t*>(pb);
    for (size_t k = 0; k < na; ++k) {
      if (ua[k] != ub[k]) {
        absl::StrAppend(&diffs, " ", name, ": first differing byte ", k, " of ", na, ";");
        return;
      }
    }
  };
  check("loss", a.loss.data(), a.loss.size() * 4, b.loss.data(), b.loss.size() * 4);
  check("z_loss", a.z_loss.data(), a.z_loss.size() * 4, b.z_loss.data(), b.z_loss.size() * 4);
  check("lse", a.lse.data(), a.lse.size() * 4, b.lse.data(), b.lse.size() * 4);
  check("predictions", a.predictions.data(), a.predictions.size() * 8, b.predictions.data(),
        b.predictions.size() * 8);
  check("accuracy", &a.accuracy, 4, &b.accuracy, 4);
  check("tokens", &a.tokens, 8, &b.tokens, 8);
  check("dx", a.dx.data(), a.dx.size(), b.dx.data(), b.dx.size());
  check("dw", a.dw.data(), a.dw.size(), b.dw.data(), b.dw.size());
  check("db", a.db.data(), a.db.size(), b.db.data(), b.db.size());
  check("dw_accum", a.dw_accum.data(), a.dw_accum.size() * 4, b.dw_accum.data(),
        b.dw_accum.size() * 4);
  check("db_accum", a.db_accum.data(), a.db_accum.size() * 4, b.db_accum.data(),
        b.db_accum.size() * 4);
  if (diffs.empty()) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "outputs differ:" << diffs;
}

TrickleRows::TrickleRows(const void* x, int64_t bt, size_t row_bytes, const Spec& spec)
    : bt_(bt), row_bytes_(row_bytes), spec_(spec),
      real_(static_cast<const uint8_t*>(x), static_cast<const uint8_t*>(x) + bt * row_bytes),
      buf_(bt * row_bytes, 0xFF) {
  thread_ = std::thread([this] { Release(); });
}

TrickleRows::~TrickleRows() { thread_.join(); }

void TrickleRows::Release() {
  const int64_t last = spec_.fail_after >= 0 ? std::min(spec_.fail_after, bt_) : bt_;
  // Uneven steps: distinct random cuts in [1, last), then `last` itself.
  std::mt19937_64 rng(spec_.seed);
  std::vector<int64_t> cuts;
  if (last > 1) {
    std::uniform_int_distribution<int64_t> any(1, last - 1);
    for (int k = 0; k + 1 < spec_.steps && static_cast<int64_t>(cuts.size()) < last - 1; ++k) {
      int64_t c = any(rng);
      while (std::find(cuts.begin(), cuts.end(), c) != cuts.end()) c = any(rng);
      cuts.push_back(c);
    }
  }
  std::sort(cuts.begin(), cuts.end());
  cuts.push_back(last);
  int64_t from = 0;
  for (int64_t to : cuts) {
    absl::SleepFor(spec_.pause);
    if (to > from) {
      std::memcpy(buf_.data() + from * row_bytes_, real_.data() + from * row_bytes_,
                  (to - from) * row_bytes_);
    }
    absl::MutexLock lock(&mu_);
    released_ = to;
    from = to;
  }
  absl::MutexLock lock(&mu_);
  done_ = true;
}

absl::Status TrickleRows::WaitX(int64_t rows) {
  absl::MutexLock lock(&mu_);
  waits_.push_back(rows);
  auto arrived = [&] { return released_ >= rows || done_; };
  mu_.Await(absl::Condition(&arrived));
  if (released_ >= rows) return absl::OkStatus();
  return spec_.failure;
}

void TrickleRows::DxReady(int64_t rows) {
  absl::MutexLock lock(&mu_);
  dx_ready_.push_back(rows);
}

std::vector<int64_t> TrickleRows::waits() const {
  absl::MutexLock lock(&mu_);
  return waits_;
}

std::vector<int64_t> TrickleRows::dx_ready() const {
  absl::MutexLock lock(&mu_);
  return dx_ready_;
}

::testing::AssertionResult TrickleRows::CallsAreValid(int64_t bt, size_t dx_calls) const {
  const std::vector<int64_t> w = waits(), d = dx_ready();
  if (w.empty()) return ::testing::AssertionFailure() << "WaitX was never called";
  for (size_t i = 0; i < w.size(); ++i) {
    if ((i > 0 && w[i] < w[i - 1]) || w[i] > bt) {
      return ::testing::AssertionFailure()
             << "WaitX call " << i << " asked for " << w[i] << " rows (before: "
             << (i > 0 ? w[i - 1] : 0) << ", BT " << bt << ")";
    }
  }
  if (w.back() != bt) {
    return ::testing::AssertionFailure() << "the last WaitX asked for " << w.back() << " of "
                                         << bt << " rows";
  }
  if (d.size() != dx_calls) {
    return ::testing::AssertionFailure() << d.size() << " DxReady calls, expected " << dx_calls;
  }
  for (size_t i = 0; i < d.size(); ++i) {
    if (d[i] <= (i > 0 ? d[i - 1] : 0)) {
      return ::testing::AssertionFailure() << "DxReady call " << i << " reported " << d[i]
                                           << " rows after " << (i > 0 ? d[i - 1] : 0);
    }
  }
  if (!d.empty() && d.back() != bt) {
    return ::testing::AssertionFailure() << "the last DxReady reported " << d.back() << " of "
                                         << bt << " rows";
  }
  return ::testing::AssertionSuccess();
}

void TrickleRows::Drain() {
  absl::MutexLock lock(&mu_);
  mu_.Await(absl::Condition(&done_));
}

std::unique_ptr<TrickleRows> ExpectComputeEndsWithTheFailedWait(
    const std::function<absl::Status(const LossProblem&, const LossOutputs&)>& compute,
    const LossProblem& whole, const absl::Status& failure, int64_t fail_after) {
  TrickleRows::Spec ts;
  ts.fail_after = fail_after;
  ts.failure = failure;
  auto rows =
      std::make_unique<TrickleRows>(whole.x, whole.bt, whole.h * DTypeSize(whole.dtype), ts);
  LossProblem streamed = whole;
  streamed.x = rows->x();
  streamed.rows = rows.get();
  HostOutputs got(whole, DType::kBF16);
  const absl::Status st = compute(streamed, got.outputs());
  EXPECT_EQ(st.code(), failure.code()) << "after " << fail_after << ": " << st;
  EXPECT_EQ(st.message(), failure.message()) << "after " << fail_after;
  // The chunk that asked past the released rows was the last one read.
  const std::vector<int64_t> waits = rows->waits();
  EXPECT_FALSE(waits.empty()) << "after " << fail_after;
  if (!waits.empty()) {
    EXPECT_GT(waits.back(), fail_after);
  }
  for (int64_t r : rows->dx_ready()) EXPECT_LE(r, fail_after) << "after " << fail_after;
  return rows;
}

absl::Status ValidateThenCompute(Backend& backend, const LossProblem& p, const LossOutputs& out,
                                 LossStats* stats) {
  absl::Status s = ValidateLossProblem(p, out);
  if (!s.ok()) return s;
  return backend.Compute(p, out, stats);
}

}  // namespace lossd
