// SPDX-License-Identifier: Apache-2.0
#include "testing/optimizer_cases.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/dtype.h"
#include "kernels/optimizer.h"

namespace lossd {
namespace {

constexpr DType kCopyCycle[3] = {DType::kBF16, DType::kF16, DType::kF32};

void AddCopyVariant(OptimizerCase c, int index, std::vector<OptimizerCase>* out) {
  c.copy = index % 4 != 3;
  c.copy_dtype = kCopyCycle[index % 4 % 3];
  c.name = absl::StrCat(c.name, "_", c.copy ? DTypeName(c.copy_dtype) : "nocopy");
  out->push_back(c);
}

}  // namespace

std::vector<OptimizerCase> AllOptimizerCases() {
  std::vector<OptimizerCase> out;
  int index = 0;
  struct Momentum {
    const char* name;
    double momentum, dampening;
    bool nesterov;
  };
  const Momentum kMomenta[] = {
      {"plain", 0, 0, false}, {"mom", 0.9, 0, false}, {"damp", 0.9, 0.3, false},
      {"nesterov", 0.9, 0, true}};
  for (const float scale : {1.0f, 0.7f}) {
    for (const double wd : {0.0, 0.01}) {
      for (const Momentum& m : kMomenta) {
        OptimizerCase c;
        c.params.kind = OptimizerKind::kSgd;
        c.params.lr = 0.05;
        c.params.weight_decay = wd;
        c.params.momentum = m.momentum;
        c.params.dampening = m.dampening;
        c.params.nesterov = m.nesterov;
        c.params.grad_scale = scale;
        c.name = absl::StrCat("sgd_", m.name, wd != 0 ? "_wd" : "", scale != 1 ? "_scaled" : "");
        AddCopyVariant(c, index++, &out);
      }
    }
    for (const double wd : {0.0, 0.1}) {
      for (const bool amsgrad : {false, true}) {
        for (const double beta1 : {0.9, 0.3}) {
          OptimizerCase c;
          c.params.kind = OptimizerKind::kAdamW;
          c.params.lr = 0.01;
          c.params.weight_decay = wd;
          c.params.amsgrad = amsgrad;
          c.params.beta1 = beta1;
          c.params.beta2 = beta1 == 0.9 ? 0.999 : 0.95;
          c.params.eps = 1e-8;
          c.params.step = 1 + index % 3;  // the first step, and runs joined later
          c.params.grad_scale = scale;
          c.name = absl::StrCat("adamw", amsgrad ? "_amsgrad" : "", wd != 0 ? "_wd" : "",
                                beta1 == 0.9 ? "" : "_beta1low", scale != 1 ? "_scaled" : "");
          AddCopyVariant(c, index++, &out);
        }
      }
    }
  }
  return out;
}

OptimizerParams ParamsAtStep(const OptimizerParams& first, int k) {
  OptimizerParams p = first;
  p.step = first.step + k;
  p.momentum_initialised = k > 0;
  return p;
}

OptimizerBuffers RandomOptimizerBuffers(const OptimizerCase& c, int64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f), small(0.0f, 0.01f);
  OptimizerBuffers b;
  b.n = n;
  b.param.resize(n);
  b.state1.resize(n);
  b.state2.resize(n);
  b.state3.resize(n);
  const bool sgd_fresh = c.params.kind == OptimizerKind::kSgd;
  for (int64_t i = 0; i < n; ++i) {
    b.param[i] = unit(rng);
    b.state1[i] = sgd_fresh ? std::numeric_limits<float>::quiet_NaN() : 0.1f * unit(rng);
    b.state2[i] = small(rng) + 1e-6f;
    b.state3[i] = i % 2 == 0 ? b.state2[i] + small(rng) : b.state2[i] * 0.5f;
  }
  b.copy.assign(static_cast<size_t>(n) * 4, 0xFF);
  return b;
}

std::vector<float> RandomGradient(int64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f), exponent(-3.0f, 1.0f);
  std::vector<float> g(n);
  for (float& x : g) {
    x = unit(rng) * std::pow(10.0f, exponent(rng));
    if (x == 0) x = 1e-3f;
  }
  return g;
}

OptimizerTensors HostTensors(const OptimizerCase& c, OptimizerBuffers& b, const float* grad) {
  OptimizerTensors t;
  t.n = b.n;
  t.param = b.param.data();
  t.grad = grad;
  t.state1 = b.state1.data();
  t.state2 = b.state2.data();
  t.state3 = b.state3.data();
  t.copy = c.copy ? b.copy.data() : nullptr;
  t.copy_dtype = c.copy_dtype;
  return t;
}

int64_t CountNan(const std::vector<float>& v) {
  int64_t n = 0;
  for (const float x : v) n += std::isnan(x);
  return n;
}

double NormwiseUlps(const std::vector<float>& a, const std::vector<double>& r) {
  double worst = 0, scale = 0;
  for (size_t i = 0; i < r.size(); ++i) {
    const double e = std::fabs(a[i] - r[i]);
    worst = std::isnan(e) ? std::numeric_limits<double>::infinity() : std::max(worst, e);
    scale = std::max(scale, std::fabs(r[i]));
  }
  return scale == 0 ? worst : worst / scale * 16777216.0;
}

double ElementwiseUlps(const std::vector<float>& a, const std::vector<double>& r) {
  double worst = 0;
  for (size_t i = 0; i < r.size(); ++i) {
    const double e = std::fabs(a[i] - r[i]);
    const double rel = r[i] == 0 ? e : e / std::fabs(r[i]);
    worst = std::isnan(rel) ? std::numeric_limits<double>::infinity() : std::max(worst, rel);
  }
  return worst * 16777216.0;
}

}  // namespace lossd
