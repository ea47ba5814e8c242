// The interface every compute backend implements (cpu/ reference-quality CPU, cuda/ GPU).
// A backend receives a validated LossProblem; it never sees gRPC or protobuf, and it never
// aborts: every failure is a Status (RESOURCE_EXHAUSTED for out-of-memory).
#ifndef LOSSD_KERNELS_BACKEND_H_
#define LOSSD_KERNELS_BACKEND_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/loss_problem.h"

namespace lossd {

// Memory owned by a backend (device memory on a GPU). Freed when destroyed.
class BackendBuffer {
 public:
  virtual ~BackendBuffer() = default;
  virtual void* data() = 0;  // backend address; host pointer only for the CPU backend
  virtual size_t size() const = 0;
};

// Page-locked ("pinned") host memory from a backend's runtime, for host buffers the backend
// copies to and from: the device's DMA engine reads and writes them directly, with no staging
// copy through driver buffers. Lives as long as the process, so memory taken from it may be
// given back after the backend that offered it is gone.
class HostMemory {
 public:
  virtual ~HostMemory() = default;
  virtual void* Allocate(size_t bytes) = 0;  // null when none can be had
  virtual void Free(void* p) = 0;
};

struct BackendInfo {
  std::string name;    // "cpu" or "cuda"
  std::string device;  // e.g. "NVIDIA H200"
  uint64_t memory_total_bytes = 0;
  uint64_t memory_used_bytes = 0;  // by everyone on the device, as the driver reports it
  uint64_t memory_peak_bytes = 0;  // highest memory this backend held at once
  uint64_t memory_held_bytes = 0;  // what this backend holds now (its caching pool aside)
  uint64_t memory_budget_bytes = 0;  // the most it may hold (0: no limit of its own)
  bool healthy = true;             // false after a sticky device error
};

class Backend {
 public:
  virtual ~Backend() = default;

  virtual BackendInfo Info() = 0;

  // Backend memory for resident tensors (cached weights, gradient accumulators).
  virtual absl::StatusOr<std::unique_ptr<BackendBuffer>> Allocate(size_t bytes) = 0;
  virtual absl::Status CopyToBackend(BackendBuffer& dst, size_t offset, const void* src,
                                     size_t bytes) = 0;
  virtual absl::Status CopyFromBackend(const BackendBuffer& src, size_t offset, void* dst,
                                       size_t bytes) = 0;
  virtual absl::Status Zero(BackendBuffer& buf) = 0;

  // Worst-case backend bytes one Compute of this shape needs beyond its inputs and outputs
  // (chunk buffers, workspaces, device copies of host inputs and outputs). The engine admits
  // a request only when this fits in the budget.
  virtual uint64_t WorkspaceBytes(const LossProblem& p, const LossOutputs& out) = 0;

  // Runs forward + backward. The problem has been validated by the engine (shapes, dtypes,
  // target range); a backend still refuses what it cannot do with INVALID_ARGUMENT.
  virtual absl::Status Compute(const LossProblem& p, const LossOutputs& out,
                               LossStats* stats) = 0;

  // This backend's pinned host memory, or null when ordinary memory is as good (CPU).
  virtual HostMemory* host_memory() { return nullptr; }
};

}  // namespace lossd

#endif  // LOSSD_KERNELS_BACKEND_H_
