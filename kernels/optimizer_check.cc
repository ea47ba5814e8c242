// SPDX-License-Identifier: Apache-2.0
#include "kernels/optimizer_check.h"

#include <cmath>
#include <cstdint>
#include <limits>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "core/dtype.h"

namespace lossd {
namespace {

absl::Status Bad(absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("optimizer step: ", what));
}

// A finite value >= lo (and < hi when hi is given); the message names the field.
absl::Status CheckScalar(absl::string_view field, double v, double lo,
                         double hi = std::numeric_limits<double>::infinity()) {
  if (std::isfinite(v) && v >= lo && v < hi) return absl::OkStatus();
  return Bad(absl::StrCat(field, " is ", v, "; it must be finite, >= ", lo,
                          std::isfinite(hi) ? absl::StrCat(" and < ", hi) : ""));
}

absl::Status CheckBuffer(absl::string_view field, const void* data, int64_t n,
                         absl::string_view why) {
  if (data != nullptr || n == 0) return absl::OkStatus();
  return Bad(absl::StrCat(field, " is null for n = ", n, " (", why, ")"));
}

absl::Status CheckSgd(const OptimizerParams& p, const OptimizerTensors& t) {
  if (auto s = CheckScalar("momentum", p.momentum, 0); !s.ok()) return s;
  if (!std::isfinite(p.dampening)) {  // torch puts no bound on it
    return Bad(absl::StrCat("dampening is ", p.dampening, "; it must be finite"));
  }
  if (p.nesterov && (p.momentum <= 0 || p.dampening != 0)) {
    return Bad(absl::StrCat("nesterov needs momentum > 0 and dampening 0; momentum is ",
                            p.momentum, ", dampening ", p.dampening));
  }
  if (p.momentum != 0) {
    return CheckBuffer("state1", t.state1, t.n, "SGD's momentum buffer, momentum != 0");
  }
  return absl::OkStatus();
}

absl::Status CheckAdamW(const OptimizerParams& p, const OptimizerTensors& t) {
  if (auto s = CheckScalar("beta1", p.beta1, 0, 1); !s.ok()) return s;
  if (auto s = CheckScalar("beta2", p.beta2, 0, 1); !s.ok()) return s;
  if (auto s = CheckScalar("eps", p.eps, 0); !s.ok()) return s;
  if (p.step < 1) return Bad(absl::StrCat("step is ", p.step, "; it must be >= 1"));
  if (auto s = CheckBuffer("state1", t.state1, t.n, "AdamW's exp_avg"); !s.ok()) return s;
  if (auto s = CheckBuffer("state2", t.state2, t.n, "AdamW's exp_avg_sq"); !s.ok()) return s;
  if (p.amsgrad) return CheckBuffer("state3", t.state3, t.n, "AdamW's max_exp_avg_sq, amsgrad");
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckOptimizerStep(const OptimizerParams& p, const OptimizerTensors& t) {
  // Every buffer is n fp32 elements: n * 4 bytes must fit in a size_t and an int64.
  if (t.n < 0 || t.n > std::numeric_limits<int64_t>::max() / 8) {
    return Bad(absl::StrCat("n is ", t.n, "; it must be >= 0 and a byte count that fits"));
  }
  if (p.kind != OptimizerKind::kSgd && p.kind != OptimizerKind::kAdamW) {
    return Bad(absl::StrCat("kind is ", static_cast<int32_t>(p.kind),
                            "; it must be 0 (SGD) or 1 (AdamW)"));
  }
  if (auto s = CheckScalar("lr", p.lr, 0); !s.ok()) return s;
  if (auto s = CheckScalar("weight_decay", p.weight_decay, 0); !s.ok()) return s;
  if (!std::isfinite(p.grad_scale)) {
    return Bad(absl::StrCat("grad_scale is ", p.grad_scale, "; it must be finite"));
  }
  if (auto s = CheckBuffer("param", t.param, t.n, "the master"); !s.ok()) return s;
  if (auto s = CheckBuffer("grad", t.grad, t.n, "the summed gradient"); !s.ok()) return s;
  if (t.copy != nullptr && !IsFloatDType(t.copy_dtype)) {
    return Bad(absl::StrCat("copy_dtype is ", DTypeName(t.copy_dtype),
                            "; the compute copy must be bf16, fp16 or fp32"));
  }
  return p.kind == OptimizerKind::kSgd ? CheckSgd(p, t) : CheckAdamW(p, t);
}

absl::Status CheckSumOfSquares(const float* data, int64_t n) {
  if (n < 0) return absl::InvalidArgumentError(absl::StrCat("sum of squares: n is ", n));
  if (data == nullptr && n > 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("sum of squares: data is null for n = ", n));
  }
  return absl::OkStatus();
}

}  // namespace lossd
