// SPDX-License-Identifier: Apache-2.0
// lossd::Backend on one CUDA GPU: copies a LossProblem's host tensors to the device (weights
// and accumulators may already be there), runs the chunked fused linear + cross-entropy
// (fused_loss.h) and copies the results back. Never aborts; out-of-memory is
// RESOURCE_EXHAUSTED and frees everything the call held; a sticky device error marks the
// backend unhealthy.
#ifndef LOSSD_KERNELS_CUDA_CUDA_BACKEND_H_
#define LOSSD_KERNELS_CUDA_CUDA_BACKEND_H_

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "kernels/backend.h"
#include "kernels/cuda/device_tuning.h"
#include "kernels/cuda/fused_loss.h"
#include "core/loss_problem.h"

namespace lossd {
namespace cuda {

struct CudaBackendOptions {
  int device = 0;
  uint64_t memory_budget_bytes = 0;  // most device bytes held at once; 0 = no own limit
  uint64_t chunk_budget_bytes = 0;   // chunk buffer + GEMM workspaces; 0 = DefaultChunkBudget
  Schedule schedule = kDefaultSchedule;
  // Pick the schedule per problem (column halves for chunks under 2048 rows when there is
  // more than one, row halves otherwise) instead of `schedule`.
  bool auto_schedule = true;
  int32_t side_sms = kDefaultSideSms;  // see ChunkPlan::side_sms
  // Time cuBLASLt's candidates on the first Compute of each shape (FusedLoss::set_autotune).
  bool autotune_gemms = true;
  // Use the whole-batch layout (PlanWhole) where it applies: a fresh dW, no chunk_rows asked.
  // Off by default: on an H200 it measured no faster than row chunks (bench/RESULTS.md).
  bool whole_batch = false;
  // Plan bf16 cross-entropy problems for the reference-exp path (FusedLoss::set_ref_exp) where
  // the plugin has it and the device is an sm_90 one: by default where the device's tuning
  // takes it (device_tuning.h: not on an H100), or forced. The plugin reads
  // LOSSD_CUDA_REF_EXP=0 / =1 as off / on.
  RefExpChoice ref_exp = RefExpChoice::kPerDevice;
  // Rows the default chunk budget holds; 0 = the device's tuning (2048, 4096 on an H100).
  int64_t default_chunk_rows = 0;
  // The plugin ABI minor (of major 6) the backend is served through (plugin.cc's
  // LOSSD_PLUGIN_ABI_MINOR), or -1: called directly, when it computes everything it can. Before
  // 6.3 the ABI carries neither LossProblem::is_ratio, PolicyParams::importance_sampling,
  // verl's options (the KL estimator, entropy_coeff, the aggregation, gpg) nor distill's
  // weights; before 6.4 not the loss types geo_mean and kl_cov, before 6.5 not vespo, before
  // 6.6 not cispo_clamp. Info then does not announce them (kPolicySequenceBit,
  // kPolicyIsRatioBit, kPolicyKlEstimatorBit, kPolicyEntropyBit, kPolicyAggregationBit,
  // kPolicyGpgBit, kDistillWeightsBit; kPolicyGeoMeanBit, kPolicyKlCovBit; kPolicyVespoBit;
  // kPolicyCispoClampBit), so the server refuses them rather than computing without them.
  int32_t plugin_abi_minor = -1;
};

// Byte counters shared by the backend and every buffer it hands out.
struct MemoryCounters {
  std::atomic<uint64_t> current{0};
  std::atomic<uint64_t> peak{0};
};

class CudaBackend : public Backend {
 public:
  // UNAVAILABLE (message "no GPU: ...") when the machine has no usable GPU.
  static absl::StatusOr<std::unique_ptr<CudaBackend>> Create(const CudaBackendOptions& options);
  ~CudaBackend() override;

  BackendInfo Info() override;
  // Whether bf16 cross-entropy problems are planned for the reference-exp path, and the
  // fused loss's counts of the chunks it ran, the rows it redid and the chunks it redid whole
  // (FusedLoss::ref_exp_chunks): for tests, benchmarks and the logs.
  bool ref_exp() const { return ref_exp_; }
  // Rows a default chunk budget holds on this device, and why this path and chunk were chosen
  // (device_tuning.h), for tests, the logs and BackendInfo.
  int64_t default_chunk_rows() const { return default_chunk_rows_; }
  const std::string& tuning_reason() const { return tuning_reason_; }
  struct RefExpCounters {
    int64_t chunks = 0, redone_rows = 0, chunk_fallbacks = 0;
  };
  RefExpCounters RefExpCounts();
  absl::StatusOr<std::unique_ptr<BackendBuffer>> Allocate(size_t bytes) override;
  absl::Status CopyToBackend(BackendBuffer& dst, size_t offset, const void* src,
                             size_t bytes) override;
  absl::Status CopyFromBackend(const BackendBuffer& src, size_t offset, void* dst,
                               size_t bytes) override;
  absl::Status Zero(BackendBuffer& buf) override;
  uint64_t WorkspaceBytes(const WorkspaceShape& shape) override;
  absl::Status Compute(const LossProblem& p, const LossOutputs& out, LossStats* stats) override;
  // Both run on the legacy default stream and wait for it, as Zero does: the Computes that
  // summed the gradient have returned (their streams drained), and the caller reads the
  // master, the copy or the norm right after. Neither takes mu_: a step touches only its
  // head's buffers, which the engine keeps from every Compute while it runs.
  absl::Status OptimizerStep(const OptimizerParams& p, const OptimizerTensors& t) override;
  absl::StatusOr<double> SumOfSquares(const float* data, int64_t n) override;
  // Page-locked memory (cudaHostAlloc, portable to every context); lives for the process.
  HostMemory* host_memory() override;
  // Head groups on NCCL, dlopened at run time (nccl_comm.h: LOSSD_NCCL_LIBRARY, else
  // libnccl.so.2); the communicator runs on this backend's device, on a stream of its own.
  // An unhealthy backend refuses them as it refuses a Compute.
  absl::Status CommAvailable() override;
  absl::StatusOr<std::string> NewCommId() override;
  absl::StatusOr<std::unique_ptr<BackendComm>> ConnectComm(const std::string& id, uint32_t size,
                                                           uint32_t rank,
                                                           int64_t timeout_ms) override;

  // The chunk plan Compute would use for a problem of this shape.
  ChunkPlan Plan(const WorkspaceShape& shape) const;
  ChunkPlan Plan(const LossProblem& p, const LossOutputs& out) const {
    return Plan(ShapeOf(p, out));
  }

 private:
  explicit CudaBackend(const CudaBackendOptions& options);
  absl::Status ComputeLocked(const LossProblem& p, const LossOutputs& out, LossStats* stats)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Device memory counted against the budget and the peak.
  absl::StatusOr<std::unique_ptr<BackendBuffer>> AllocateDevice(size_t bytes);
  // Marks the backend unhealthy when `s` came with a sticky device error; returns `s`.
  absl::Status Check(absl::Status s);
  // UNAVAILABLE naming `call`: what every entry point answers once the backend is unhealthy.
  absl::Status Unhealthy(absl::string_view call) const;

  CudaBackendOptions options_;
  std::string device_name_;
  std::shared_ptr<MemoryCounters> counters_;
  std::atomic<bool> healthy_{true};
  // Allocations and frees are ordered on this stream, which runs no work (DeviceBuffer). Not
  // destroyed with a backend that was made: buffers may be freed after it is gone.
  cudaStream_t alloc_stream_ = nullptr;
  bool created_ = false;  // Create succeeded (see the destructor)
  bool ref_exp_ = false;  // the fused loss takes the reference-exp path (options and device allow)
  int64_t default_chunk_rows_ = kMinDefaultChunkRows;
  std::string tuning_reason_;
  absl::Mutex mu_;  // one Compute at a time: the fused loss's streams and cuBLASLt choices
  std::unique_ptr<FusedLoss> fused_ ABSL_GUARDED_BY(mu_);
  // The overlapped path (LossProblem::rows): X rows go up on x_stream_ and dX rows come down
  // on dx_stream_, beside the fused loss's streams, so neither copy waits behind a GEMM.
  cudaStream_t x_stream_ ABSL_GUARDED_BY(mu_) = nullptr;
  cudaStream_t dx_stream_ ABSL_GUARDED_BY(mu_) = nullptr;
  cudaEvent_t x_start_ ABSL_GUARDED_BY(mu_) = nullptr;   // main_ before the first X rows
  cudaEvent_t x_copied_ ABSL_GUARDED_BY(mu_) = nullptr;  // the latest X rows are up
  cudaEvent_t dx_done_ ABSL_GUARDED_BY(mu_) = nullptr;   // the latest dX GEMM has run
};

}  // namespace cuda
}  // namespace lossd

#endif  // LOSSD_KERNELS_CUDA_CUDA_BACKEND_H_
