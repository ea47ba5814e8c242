// SPDX-License-Identifier: Apache-2.0
// A Backend that hands every call to an inner backend: the base of tests' stand-ins that change
// one or two calls (a fault injected into Compute, collectives of their own) and leave the
// rest to a real backend.
#ifndef LOSSD_TESTING_FORWARDING_BACKEND_H_
#define LOSSD_TESTING_FORWARDING_BACKEND_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/loss_problem.h"
#include "kernels/backend.h"

namespace lossd {

class ForwardingBackend : public Backend {
 public:
  explicit ForwardingBackend(std::unique_ptr<Backend> inner) : inner_(std::move(inner)) {}

  BackendInfo Info() override { return inner_->Info(); }
  absl::StatusOr<std::unique_ptr<BackendBuffer>> Allocate(size_t bytes) override {
    return inner_->Allocate(bytes);
  }
  absl::Status CopyToBackend(BackendBuffer& dst, size_t offset, const void* src,
                             size_t bytes) override {
    return inner_->CopyToBackend(dst, offset, src, bytes);
  }
  absl::Status CopyFromBackend(const BackendBuffer& src, size_t offset, void* dst,
                               size_t bytes) override {
    return inner_->CopyFromBackend(src, offset, dst, bytes);
  }
  absl::Status Zero(BackendBuffer& buf) override { return inner_->Zero(buf); }
  uint64_t WorkspaceBytes(const WorkspaceShape& shape) override {
    return inner_->WorkspaceBytes(shape);
  }
  absl::Status Compute(const LossProblem& p, const LossOutputs& out, LossStats* stats) override {
    return inner_->Compute(p, out, stats);
  }
  absl::Status OptimizerStep(const OptimizerParams& p, const OptimizerTensors& t) override {
    return inner_->OptimizerStep(p, t);
  }
  absl::StatusOr<double> SumOfSquares(const float* data, int64_t n) override {
    return inner_->SumOfSquares(data, n);
  }

 protected:
  Backend& inner() { return *inner_; }

 private:
  std::unique_ptr<Backend> inner_;
};

}  // namespace lossd

#endif  // LOSSD_TESTING_FORWARDING_BACKEND_H_
