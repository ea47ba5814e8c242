// SPDX-License-Identifier: Apache-2.0
#include "testing/test_util.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "gtest/gtest.h"
#include "kernels/cpu/reference.h"
#include "core/dtype.h"
#include "core/loss_problem.h"
#include "core/loss_problem_check.h"
#include "testing/row_logits.h"

namespace lossd {
namespace {

using test_util_internal::RowLogitCalculator;
using test_util_internal::Softcapped;

std::vector<uint8_t> StoreAll(const std::vector<float>& v, DType t) {
  std::vector<uint8_t> out(v.size() * DTypeSize(t));
  for (size_t i = 0; i < v.size(); ++i) StoreFromFloat(out.data(), t, i, v[i]);
  return out;
}

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

RandomProblemSpec ShapeSpec(int64_t bt, int64_t h, int64_t v, DType dtype) {
  RandomProblemSpec spec;
  spec.bt = bt;
  spec.h = h;
  spec.v = v;
  spec.dtype = dtype;
  return spec;
}

RandomProblemSpec SpecOf(int64_t bt, int64_t h, int64_t v, DType dtype, const OptionCase& c,
                         float grad_scale, uint64_t seed) {
  RandomProblemSpec spec = ShapeSpec(bt, h, v, dtype);
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

bool HasNonFinite(const void* data, DType t, int64_t n) {
  for (int64_t k = 0; k < n; ++k) {
    if (!std::isfinite(LoadAsFloat(data, t, k))) return true;
  }
  return false;
}

void ExpectOverflowingGradientsReported(
    const std::function<absl::Status(const LossProblem&, const LossOutputs&, LossStats*)>&
        compute,
    RandomProblemSpec spec) {
  const DType dtype = spec.dtype;
  const RandomProblem ordinary = RandomProblem::Make(spec);
  spec.options.grad_scale = 3e38f;
  const RandomProblem huge = RandomProblem::Make(spec);
  LossStats stats;
  stats.nonfinite = ~0u;  // poisoned: must be overwritten
  HostOutputs fine(ordinary.problem(), dtype);
  ASSERT_TRUE(compute(ordinary.problem(), fine.outputs(), &stats).ok());
  EXPECT_EQ(stats.nonfinite, 0u) << DTypeName(dtype);

  const LossProblem p = huge.problem();
  HostOutputs got(p, dtype);
  ASSERT_TRUE(compute(p, got.outputs(), &stats).ok());
  ASSERT_TRUE(HasNonFinite(got.dw.data(), dtype, p.v * p.h)) << "the case no longer overflows";
  const uint32_t expect = (HasNonFinite(got.dx.data(), dtype, p.bt * p.h) ? kNonFiniteDx : 0u) |
                          kNonFiniteDw |
                          (HasNonFinite(got.db.data(), dtype, p.v) ? kNonFiniteDb : 0u);
  EXPECT_EQ(stats.nonfinite, expect) << DTypeName(dtype);
}

absl::Status ValidateThenCompute(Backend& backend, const LossProblem& p, const LossOutputs& out,
                                 LossStats* stats) {
  absl::Status s = ValidateLossProblem(p, out);
  if (!s.ok()) return s;
  return backend.Compute(p, out, stats);
}

}  // namespace lossd
