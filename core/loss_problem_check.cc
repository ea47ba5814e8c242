#include "core/loss_problem_check.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"

namespace lossd {
namespace {

bool KnownMemory(Memory m) { return m == Memory::kHost || m == Memory::kBackend; }

}  // namespace

absl::Status CheckReduction(const LossOptions& o, bool has_grad_output) {
  if (o.reduction != Reduction::kMean && o.reduction != Reduction::kSum &&
      o.reduction != Reduction::kNone) {
    return absl::InvalidArgumentError(
        absl::StrCat("options.reduction ", static_cast<int>(o.reduction), " is unknown"));
  }
  if (has_grad_output && o.reduction != Reduction::kNone) {
    return absl::InvalidArgumentError(
        "grad_output is only accepted with reduction none (use options.grad_scale for mean "
        "and sum)");
  }
  return absl::OkStatus();
}

absl::Status CheckOptionRanges(const LossOptions& o) {
  // Written as !(in range) so that a NaN is refused too.
  if (!(o.label_smoothing >= 0.0f && o.label_smoothing <= 1.0f)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "options.label_smoothing must be in [0, 1], got ", o.label_smoothing));
  }
  if (!(o.z_loss_scale >= 0.0f) || !std::isfinite(o.z_loss_scale)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "options.lse_square_scale must be finite and >= 0, got ", o.z_loss_scale));
  }
  if (!(o.softcap >= 0.0f) || !std::isfinite(o.softcap)) {
    return absl::InvalidArgumentError(
        absl::StrCat("options.softcap must be finite and >= 0 (0 = off), got ", o.softcap));
  }
  if (!std::isfinite(o.grad_scale)) {
    return absl::InvalidArgumentError(
        absl::StrCat("options.grad_scale must be finite, got ", o.grad_scale));
  }
  return absl::OkStatus();
}

absl::Status CheckChunkRows(const LossOptions& o) {
  if (o.chunk_rows < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("options.chunk_rows must be >= 0 (0 = automatic), got ", o.chunk_rows));
  }
  return absl::OkStatus();
}

absl::Status CheckLossOptions(const LossOptions& o, bool has_grad_output) {
  LOSSD_RETURN_IF_ERROR(CheckReduction(o, has_grad_output));
  LOSSD_RETURN_IF_ERROR(CheckOptionRanges(o));
  return CheckChunkRows(o);
}

absl::Status CheckTargets(const void* targets, DType target_dtype, int64_t bt, int64_t v,
                          int64_t ignore_index) {
  for (int64_t i = 0; i < bt; ++i) {
    const int64_t t = LoadAsInt(targets, target_dtype, i);
    if (t != ignore_index && (t < 0 || t >= v)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "targets[", i, "] = ", t, " is outside [0, V=", v, ") and is not ignore_index (",
          ignore_index, ")"));
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateLossInputs(const LossProblem& p) {
  if (p.bt < 0 || p.h <= 0 || p.v <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "loss problem: shape must have bt >= 0, h > 0, v > 0; got bt=", p.bt, " h=", p.h,
        " v=", p.v));
  }
  if (!IsFloatDType(p.dtype)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "loss problem: dtype must be bf16, fp16 or fp32; got ", DTypeName(p.dtype)));
  }
  if (p.target_dtype != DType::kI32 && p.target_dtype != DType::kI64) {
    return absl::InvalidArgumentError(absl::StrCat(
        "loss problem: target_dtype must be int32 or int64; got ", DTypeName(p.target_dtype)));
  }
  if (p.w == nullptr || (p.bt > 0 && (p.x == nullptr || p.targets == nullptr))) {
    return absl::InvalidArgumentError("loss problem: x, w and targets must be non-null");
  }
  if (!KnownMemory(p.w_memory)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "loss problem: w_memory ", static_cast<int>(p.w_memory), " is unknown"));
  }
  LOSSD_RETURN_IF_ERROR(CheckLossOptions(p.options, p.grad_output != nullptr));
  return CheckTargets(p.targets, p.target_dtype, p.bt, p.v, p.options.ignore_index);
}

absl::Status ValidateLossOutputs(const LossProblem& p, const LossOutputs& out) {
  if (out.grad_dtype != p.dtype && out.grad_dtype != DType::kF32) {
    return absl::InvalidArgumentError(
        absl::StrCat("loss problem: grad_dtype must be fp32 or the input dtype ",
                     DTypeName(p.dtype), "; got ", DTypeName(out.grad_dtype)));
  }
  if (p.bias == nullptr && (out.db != nullptr || out.db_accum != nullptr)) {
    return absl::InvalidArgumentError("loss problem: db requested but the problem has no bias");
  }
  if (!KnownMemory(out.accum_memory)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "loss problem: accum_memory ", static_cast<int>(out.accum_memory), " is unknown"));
  }
  return absl::OkStatus();
}

absl::Status ValidateLossProblem(const LossProblem& p, const LossOutputs& out) {
  LOSSD_RETURN_IF_ERROR(ValidateLossInputs(p));
  return ValidateLossOutputs(p, out);
}

void DieUnlessValidProblem(const LossProblem& p, const LossOutputs* out, const char* who) {
  absl::Status s = ValidateLossInputs(p);
  if (s.ok() && out != nullptr) s = ValidateLossOutputs(p, *out);
  if (s.ok()) return;
  std::fprintf(stderr, "%s was handed a problem that was never validated: %s\n", who,
               std::string(s.message()).c_str());
  std::abort();
}

}  // namespace lossd
