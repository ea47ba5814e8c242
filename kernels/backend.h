// SPDX-License-Identifier: Apache-2.0
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
#include "kernels/optimizer.h"

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
  // LossKindBit of every LossKind this backend computes; others are refused by the engine
  // (UNIMPLEMENTED, naming the backend) before any tensor is read.
  uint32_t loss_kinds = LossKindBit(LossKind::kCrossEntropy);
  // The compute path a Compute takes, for operators (ServerInfo.compute_path): the CPU
  // backend's name; on the CUDA backend the cross-entropy path the device chose (reference-exp
  // or row-chunk) and its default chunk rows. Empty: not reported (a plugin of ABI 6.0).
  std::string compute_path;
};

// Whether a Compute writes a gradient, adds it into an fp32 accumulator, or skips it.
enum class GradOut : int32_t { kNone = 0, kWritten = 1, kAccumulated = 2 };

// What a Compute's workspace depends on: the problem's shape and which of its inputs and
// outputs exist, never their data. The engine asks with it before a request's tensors have
// arrived; a backend's Compute plans from ShapeOf(problem, outputs), so both see one number.
struct WorkspaceShape {
  int64_t bt = 0;  // rows (tokens)
  int64_t h = 0;   // hidden size
  int64_t v = 0;   // vocabulary size
  DType dtype = DType::kBF16;       // of X, W and bias
  DType grad_dtype = DType::kBF16;  // of dx, dw, db
  Memory w_memory = Memory::kHost;  // where W and the bias live
  bool has_bias = false;
  bool has_class_weights = false;
  bool has_grad_output = false;
  bool rows_streamed = false;  // X arrives while the Compute runs (LossProblem::rows)
  int64_t chunk_rows = 0;      // LossOptions::chunk_rows, the one option that changes memory
  bool want_dx = false;
  GradOut dw = GradOut::kNone;  // kAccumulated: added into LossOutputs::dw_accum
  GradOut db = GradOut::kNone;  // kAccumulated: added into LossOutputs::db_accum
  Memory accum_memory = Memory::kHost;  // where the accumulators live
  LossKind kind = LossKind::kCrossEntropy;
  int64_t teacher_h = 0;                    // kDistill: the teacher's hidden size
  int64_t teacher_topk = 0;                 // kDistill: k of a top-k teacher (then no head)
  Memory teacher_w_memory = Memory::kHost;  // kDistill: where the teacher's W lives
  bool want_entropy = false;                // kLogprob: LossOutputs::entropy
};

// The shape of a real problem: what its pointers say is present. An accumulator wins over a
// plain output, as in every backend's Compute.
inline WorkspaceShape ShapeOf(const LossProblem& p, const LossOutputs& out) {
  WorkspaceShape s;
  s.bt = p.bt;
  s.h = p.h;
  s.v = p.v;
  s.dtype = p.dtype;
  s.grad_dtype = out.grad_dtype;
  s.w_memory = p.w_memory;
  s.has_bias = p.bias != nullptr;
  s.has_class_weights = p.class_weights != nullptr;
  s.has_grad_output = p.grad_output != nullptr;
  s.rows_streamed = p.rows != nullptr;
  s.chunk_rows = p.options.chunk_rows;
  s.want_dx = out.dx != nullptr;
  s.dw = out.dw_accum != nullptr ? GradOut::kAccumulated
         : out.dw != nullptr     ? GradOut::kWritten
                                 : GradOut::kNone;
  s.db = out.db_accum != nullptr ? GradOut::kAccumulated
         : out.db != nullptr     ? GradOut::kWritten
                                 : GradOut::kNone;
  s.accum_memory = out.accum_memory;
  s.kind = p.kind;
  s.teacher_h = p.kind == LossKind::kDistill ? p.teacher_h : 0;
  s.teacher_topk = p.kind == LossKind::kDistill ? p.teacher_topk : 0;
  s.teacher_w_memory = p.teacher_w_memory;
  s.want_entropy = out.entropy != nullptr;
  return s;
}

// A communicator among the backends of a head group's S members (NCCL on the CUDA backend),
// over buffers this backend allocated. Every member calls each collective in the same order.
// Member m's slice of an n-element tensor is [n * m / S, n * (m + 1) / S) (the engine's
// HeadSliceOf). A collective that does not finish within the timeout given at connect, or
// that loses a peer, fails (UNAVAILABLE naming what the backend saw) and aborts the
// communicator: every later call fails at once. A failed collective leaves the buffer's
// contents unspecified.
class BackendComm {
 public:
  virtual ~BackendComm() = default;
  // buf: n fp32 elements, the same n on every member. Afterwards member m's slice of buf
  // holds that slice of the sum over the members (the rest of buf is unspecified).
  virtual absl::Status ReduceScatter(float* buf, int64_t n) = 0;
  // buf: n elements of elem_bytes each, the same n on every member; member m's slice holds
  // its part. Afterwards every member's buf holds every part.
  virtual absl::Status AllGather(void* buf, int64_t n, size_t elem_bytes) = 0;
  // Ends any collective in flight (it fails) and refuses every later one. Safe from another
  // thread while a collective runs; idempotent.
  virtual void Abort() = 0;
};

// NCCL's communicator id is 128 opaque bytes; member 0 makes it, the others receive it.
inline constexpr size_t kBackendCommIdBytes = 128;

class Backend {
 protected:
  static absl::Status NoComm() {
    return absl::UnimplementedError("this backend has no collectives of its own");
  }

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
  virtual uint64_t WorkspaceBytes(const WorkspaceShape& shape) = 0;

  // Runs forward + backward. The problem has been validated by the engine (shapes, dtypes,
  // target range); a backend still refuses what it cannot do with INVALID_ARGUMENT.
  virtual absl::Status Compute(const LossProblem& p, const LossOutputs& out,
                               LossStats* stats) = 0;

  // One optimizer step of a hosted head over backend-resident fp32 buffers (Allocate's):
  // torch's SGD or AdamW in fp32, in torch's single-tensor operation order, then t.copy set
  // to the cast of the new master. Elementwise: the result does not depend on how the work is
  // split. INVALID_ARGUMENT (CheckOptimizerStep) for what torch would refuse or a missing
  // buffer; NaN and Inf in the data are computed through, never refused.
  virtual absl::Status OptimizerStep(const OptimizerParams& p, const OptimizerTensors& t) = 0;

  // Sum of x*x over n backend-resident fp32 elements, accumulated in double: the squared
  // norm of a head's gradient, for clipping. The same data gives the same bits every time;
  // Inf and NaN in the data come back as Inf or NaN. INVALID_ARGUMENT for n < 0 or null data.
  virtual absl::StatusOr<double> SumOfSquares(const float* data, int64_t n) = 0;

  // This backend's pinned host memory, or null when ordinary memory is as good (CPU).
  virtual HostMemory* host_memory() { return nullptr; }

  // Head groups' collectives on this backend's memory. CommAvailable says whether this
  // backend can form one (the CUDA backend: NCCL's library loads), before a head's tensors
  // are uploaded; NewCommId makes the id member 0 hands the others (kBackendCommIdBytes);
  // ConnectComm joins the communicator of `size` members as `rank`, blocking until every
  // member has joined, or failing after timeout_ms (DEADLINE_EXCEEDED). UNIMPLEMENTED where
  // the backend has none: the CPU backend's groups run on gloo over host memory, in the
  // engine (engine/head_group.h).
  virtual absl::Status CommAvailable() { return NoComm(); }
  virtual absl::StatusOr<std::string> NewCommId() { return NoComm(); }
  virtual absl::StatusOr<std::unique_ptr<BackendComm>> ConnectComm(const std::string& id,
                                                                   uint32_t size,
                                                                   uint32_t rank,
                                                                   int64_t timeout_ms) {
    (void)id, (void)size, (void)rank, (void)timeout_ms;
    return NoComm();
  }
};

}  // namespace lossd

#endif  // LOSSD_KERNELS_BACKEND_H_
