// SPDX-License-Identifier: Apache-2.0
// A backend for the loss kinds' plumbing tests (testonly): it claims the kinds it is given
// (BackendInfo::loss_kinds), keeps resident memory in a CPU backend, computes cross-entropy
// there, and for every other kind records what the engine handed it (the kind, options,
// per-row inputs, the teacher's bytes and where they lived, which outputs were asked for, the
// workspace shape) and writes known values derived from the inputs, so a test can check that
// each tensor went where it belongs, both ways. The math is the real backends'; not this.
#ifndef LOSSD_TESTING_KINDS_BACKEND_H_
#define LOSSD_TESTING_KINDS_BACKEND_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "kernels/backend.h"

namespace lossd {

// What the last non-cross-entropy Compute (and the last WorkspaceBytes) saw.
struct KindsSeen {
  int computes = 0;
  LossProblem problem;  // its pointers are dangling after the call; the copies below are not
  LossOutputs outputs;  // only which pointers were set
  std::vector<float> dlogp, dentropy, advantages, old_logp, ref_logp;  // empty: null
  std::vector<uint8_t> teacher_x, teacher_w, teacher_bias;            // empty: null
  bool targets_null = false;
  WorkspaceShape shape;
};

// The values the fake writes for a problem of kind k over `rows` rows: logp_i and entropy_i,
// the loss, kl and clip_fraction; and 1 added to every element of an accumulator.
float FakeLogp(const LossProblem& p, int64_t i);  // i + (dlogp or advantages)[i], or i
float FakeEntropy(int64_t i);                     // 0.25 i + 1
inline constexpr float kFakeLoss = 1.25f, kFakeKl = 0.125f, kFakeClipFraction = 0.375f;

class KindsBackend : public Backend {
 public:
  KindsBackend(uint32_t loss_kinds, std::shared_ptr<KindsSeen> seen);
  BackendInfo Info() override;
  absl::StatusOr<std::unique_ptr<BackendBuffer>> Allocate(size_t bytes) override;
  absl::Status CopyToBackend(BackendBuffer& dst, size_t offset, const void* src,
                             size_t bytes) override;
  absl::Status CopyFromBackend(const BackendBuffer& src, size_t offset, void* dst,
                               size_t bytes) override;
  absl::Status Zero(BackendBuffer& buf) override;
  uint64_t WorkspaceBytes(const WorkspaceShape& shape) override;
  absl::Status Compute(const LossProblem& p, const LossOutputs& out, LossStats* stats) override;
  absl::Status OptimizerStep(const OptimizerParams& p, const OptimizerTensors& t) override;
  absl::StatusOr<double> SumOfSquares(const float* data, int64_t n) override;

 private:
  const uint32_t loss_kinds_;
  std::shared_ptr<KindsSeen> seen_;
  std::unique_ptr<Backend> cpu_;
};

}  // namespace lossd

#endif  // LOSSD_TESTING_KINDS_BACKEND_H_
