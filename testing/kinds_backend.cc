// SPDX-License-Identifier: Apache-2.0
#include "testing/kinds_backend.h"

#include <cstring>
#include <utility>

#include "core/loss_problem_check.h"
#include "kernels/cpu/cpu_backend.h"

namespace lossd {
namespace {

std::vector<float> Rows(const float* p, int64_t bt) {
  return p == nullptr ? std::vector<float>() : std::vector<float>(p, p + bt);
}

std::vector<uint8_t> Bytes(const void* p, uint64_t n) {
  if (p == nullptr) return {};
  const uint8_t* b = static_cast<const uint8_t*>(p);
  return std::vector<uint8_t>(b, b + n);
}

}  // namespace

float FakeLogp(const LossProblem& p, int64_t i) {
  const float* from = p.dlogp != nullptr ? p.dlogp : p.advantages;
  return static_cast<float>(i) + (from != nullptr ? from[i] : 0.0f);
}

float FakeEntropy(int64_t i) { return 0.25f * static_cast<float>(i) + 1.0f; }

KindsBackend::KindsBackend(uint32_t loss_kinds, std::shared_ptr<KindsSeen> seen)
    : loss_kinds_(loss_kinds), seen_(std::move(seen)), cpu_(NewCpuBackend(1)) {}

BackendInfo KindsBackend::Info() {
  BackendInfo info = cpu_->Info();
  info.name = "kinds-fake";
  info.loss_kinds = loss_kinds_;
  return info;
}

absl::StatusOr<std::unique_ptr<BackendBuffer>> KindsBackend::Allocate(size_t bytes) {
  return cpu_->Allocate(bytes);
}
absl::Status KindsBackend::CopyToBackend(BackendBuffer& dst, size_t offset, const void* src,
                                         size_t bytes) {
  return cpu_->CopyToBackend(dst, offset, src, bytes);
}
absl::Status KindsBackend::CopyFromBackend(const BackendBuffer& src, size_t offset, void* dst,
                                           size_t bytes) {
  return cpu_->CopyFromBackend(src, offset, dst, bytes);
}
absl::Status KindsBackend::Zero(BackendBuffer& buf) { return cpu_->Zero(buf); }
absl::Status KindsBackend::OptimizerStep(const OptimizerParams& p, const OptimizerTensors& t) {
  return cpu_->OptimizerStep(p, t);
}
absl::StatusOr<double> KindsBackend::SumOfSquares(const float* data, int64_t n) {
  return cpu_->SumOfSquares(data, n);
}

uint64_t KindsBackend::WorkspaceBytes(const WorkspaceShape& shape) {
  if (shape.kind != LossKind::kCrossEntropy) seen_->shape = shape;
  return cpu_->WorkspaceBytes(shape);
}

absl::Status KindsBackend::Compute(const LossProblem& p, const LossOutputs& out,
                                   LossStats* stats) {
  if (p.kind == LossKind::kCrossEntropy) return cpu_->Compute(p, out, stats);
  LOSSD_DCHECK_VALID_PROBLEM(p, &out, "KindsBackend");
  KindsSeen& s = *seen_;
  ++s.computes;
  s.problem = p;
  s.outputs = out;
  s.dlogp = Rows(p.dlogp, p.bt);
  s.dentropy = Rows(p.dentropy, p.bt);
  s.advantages = Rows(p.advantages, p.bt);
  s.old_logp = Rows(p.old_logp, p.bt);
  s.ref_logp = Rows(p.ref_logp, p.bt);
  s.targets_null = p.targets == nullptr;
  const uint64_t es = DTypeSize(p.dtype);
  s.teacher_x = Bytes(p.teacher_x, p.bt * p.teacher_h * es);
  // CPU backend memory is host memory, wherever the engine says it lives.
  s.teacher_w = Bytes(p.teacher_w, p.v * p.teacher_h * es);
  s.teacher_bias = Bytes(p.teacher_bias, p.v * es);
  s.shape = ShapeOf(p, out);
  for (int64_t i = 0; i < p.bt; ++i) {
    if (out.logp != nullptr) out.logp[i] = FakeLogp(p, i);
    if (out.entropy != nullptr) out.entropy[i] = FakeEntropy(i);
  }
  if (out.loss != nullptr) *out.loss = kFakeLoss;
  if (out.tokens != nullptr) *out.tokens = p.bt;
  if (out.kl != nullptr) *out.kl = kFakeKl;
  if (out.clip_fraction != nullptr) *out.clip_fraction = kFakeClipFraction;
  const uint64_t gs = DTypeSize(out.grad_dtype);
  if (out.dx != nullptr) std::memset(out.dx, 0, p.bt * p.h * gs);
  if (out.dw != nullptr) std::memset(out.dw, 0, p.v * p.h * gs);
  if (out.db != nullptr) std::memset(out.db, 0, p.v * gs);
  if (out.dw_accum != nullptr) {
    for (int64_t i = 0; i < p.v * p.h; ++i) out.dw_accum[i] += 1.0f;
  }
  if (out.db_accum != nullptr) {
    for (int64_t i = 0; i < p.v; ++i) out.db_accum[i] += 1.0f;
  }
  stats->chunk_rows = p.bt;
  return absl::OkStatus();
}

}  // namespace lossd
