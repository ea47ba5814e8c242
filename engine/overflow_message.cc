// SPDX-License-Identifier: Apache-2.0
#include "engine/overflow_message.h"

#include <cmath>
#include <cstdint>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/loss_problem_check.h"

namespace lossd {
namespace {

// log(FLT_MAX): exp of anything above it is inf in fp32 (as a CUDA backend computes it, and
// as Liger-Kernel's losses do; the CPU backend's double overflows later, in the sum).
constexpr double kFp32ExpMax = 88.72283935546875;

// Each row's log p(target) at the plan's temperature, from a forward-only kLogprob over p's
// rows (0 on ignored rows); empty where that forward fails.
std::vector<float> RowLogp(Backend& backend, const LossProblem& p) {
  LossProblem q = p;
  q.kind = LossKind::kLogprob;
  q.dlogp = q.dentropy = q.advantages = q.old_logp = q.ref_logp = q.is_ratio = nullptr;
  q.grad_output = nullptr;
  std::vector<float> logp(p.bt), loss(p.bt);
  int64_t tokens = 0;
  LossOutputs out;
  out.grad_dtype = p.dtype;  // no gradient is asked for
  out.loss = loss.data();
  out.tokens = &tokens;
  out.logp = logp.data();
  LossStats stats;
  if (!ValidateLossProblem(q, out).ok() || !backend.Compute(q, out, &stats).ok()) return {};
  return logp;
}

bool Ignored(const LossProblem& p, int64_t i) {
  const int64_t t = p.target_dtype == DType::kI32 ? static_cast<const int32_t*>(p.targets)[i]
                                                  : static_cast<const int64_t*>(p.targets)[i];
  return t == p.options.ignore_index;
}

// The policy's first row whose KL term or importance ratio overflows fp32, named with its
// inputs; "" where none does (the logits are then to blame).
std::string PolicyCulprit(Backend& backend, const LossProblem& p) {
  const bool kl = p.policy.beta != 0.0f && p.ref_logp != nullptr;
  if (!kl && p.old_logp == nullptr) return "";
  const std::vector<float> logp = RowLogp(backend, p);
  for (int64_t i = 0; i < static_cast<int64_t>(logp.size()); ++i) {
    if (Ignored(p, i) || !std::isfinite(logp[i])) continue;
    const double lp = logp[i];
    if (kl && p.ref_logp[i] - lp > kFp32ExpMax) {
      return absl::StrCat(
          "the KL term exp(ref_logp - logp) overflows fp32 at row ", i, ": ref_logp[", i,
          "] = ", p.ref_logp[i], ", logp = ", lp, " (log p of its target at temperature ",
          p.options.temperature, "), ref_logp - logp = ", p.ref_logp[i] - lp, " > ",
          kFp32ExpMax, "; check ref_logp (the same tokens, temperature and reference model?)");
    }
    if (p.old_logp != nullptr && lp - p.old_logp[i] > kFp32ExpMax) {
      return absl::StrCat(
          "the importance ratio exp(logp - old_logp) overflows fp32 at row ", i, ": old_logp[",
          i, "] = ", p.old_logp[i], ", logp = ", lp, " (log p of its target at temperature ",
          p.options.temperature, "), logp - old_logp = ", lp - p.old_logp[i], " > ",
          kFp32ExpMax, "; check old_logp");
    }
  }
  return "";
}

}  // namespace

bool LossIsFinite(const ComputePlan& plan, const LossOutputs& out) {
  const int64_t n = plan.options.reduction == Reduction::kNone ? plan.bt : 1;
  for (int64_t i = 0; i < n; ++i) {
    if (!std::isfinite(out.loss[i])) return false;
  }
  return true;
}

std::string OverflowMessage(Backend& backend, const ComputePlan& plan, const LossProblem& p) {
  // Where the refusal is not wanted: a loss type's caller that filters non-finite steps.
  const char* const escape =
      " (header.allow_nonfinite_loss answers it with the inf or NaN instead, where the server "
      "lists nonfinite_loss; never into an accumulator or a head)";
  if (plan.kind == LossKind::kPolicy) {
    const std::string culprit = PolicyCulprit(backend, p);
    if (!culprit.empty()) {
      return absl::StrCat("the loss is not finite (kind policy): ", culprit, escape);
    }
  }
  if (plan.kind != LossKind::kCrossEntropy) {
    return absl::StrCat("the loss is not finite (kind ", LossKindName(plan.kind),
                        "): the logits X W^T (+ b) over the temperature (",
                        plan.options.temperature, ") or the per-row inputs exceed fp32; scale "
                        "them down", escape);
  }
  return absl::StrCat(
      "the loss is not finite: the logits X W^T (+ b) or the z-loss (lse_square_scale=",
      plan.options.z_loss_scale, ") exceed fp32; scale them down", escape);
}

}  // namespace lossd
