// SPDX-License-Identifier: Apache-2.0
// One CudaBackend Compute's host-device traffic: the call's device buffers, the uploads of
// the inputs, the device outputs, the copies and casts of the results back (with the
// non-finite checks of the final outputs), and the host reductions of the per-row statistics.
// It never runs the fused loss itself (FusedLoss does) and never validates a problem.
#ifndef LOSSD_KERNELS_CUDA_DEVICE_IO_H_
#define LOSSD_KERNELS_CUDA_DEVICE_IO_H_

#include <cuda_runtime_api.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/loss_problem.h"
#include "kernels/backend.h"
#include "kernels/cuda/fused_loss.h"

namespace lossd {
namespace cuda {

// Device bytes in the pool's 256-byte granules: how PlanDeviceBytes, a Compute's buffers and
// AllocateDevice count alike.
inline uint64_t Align(uint64_t x) { return (x + 255) / 256 * 256; }

// One Compute's device buffers: each lives until the end of the call (in `held`), and every
// upload and download is queued on the engine's stream.
class CallBuffers {
 public:
  using AllocateFn = std::function<absl::StatusOr<std::unique_ptr<BackendBuffer>>(uint64_t)>;
  CallBuffers(AllocateFn allocate, std::vector<std::unique_ptr<BackendBuffer>>* held,
              cudaStream_t stream)
      : allocate_(std::move(allocate)), held_(held), stream_(stream) {}

  cudaStream_t stream() const { return stream_; }

  // A device buffer of n bytes, held until the end of the call.
  absl::StatusOr<void*> Alloc(uint64_t n);

  // A device buffer of n bytes at *dst, holding a copy of the host `src`.
  absl::Status Upload(const void* src, uint64_t n, void** dst);

  // Queues a copy of n device bytes at `src` to the host `dst`.
  absl::Status Download(void* dst, const void* src, uint64_t n);

 private:
  AllocateFn allocate_;
  std::vector<std::unique_ptr<BackendBuffer>>* held_;
  cudaStream_t stream_;
};

// The per-row statistics and the non-finite flags, copied back to the host.
struct HostRows {
  explicit HostRows(int64_t bt) : lse(bt), ce(bt), zl(bt), pred(bt) {}
  std::vector<float> lse, ce, zl;  // (BT)
  std::vector<int32_t> pred;       // (BT)
  uint32_t nonfinite = 0;          // LossStats' NonFiniteBits
};

// Where AllocateOutputs put what DeviceLossArgs does not hold.
struct DeviceOutputs {
  char* rows_base = nullptr;  // the per-row statistics, then the non-finite flag word
  void* dw_cast = nullptr;    // (V, H) grad dtype: a 16-bit dW cast from the fp32 sum, or null
  void* db_cast = nullptr;    // (V) grad dtype: db cast from the fp32 sum, or null
};

// The engine's arguments but the device pointers: shape, options and the targets' summary,
// with the largest upstream gradient for reduction none.
DeviceLossArgs MakeArgs(const LossProblem& p, const TargetSummary& summary);

// The inputs on the device: X (or, overlapped, a zeroed X the hooks fill in: *x_device), W and
// the bias unless they live there already, the targets, class weights and upstream gradient.
absl::Status UploadInputs(CallBuffers& m, const LossProblem& p,
                          const std::vector<int32_t>& targets32,  // (BT) -1 for ignored rows
                          DeviceLossArgs* a, void** x_device);

// The outputs on the device: the per-row statistics (and the flag word after them), dX, and dW
// and db: straight into a device accumulator, through a device copy of a host accumulator, or
// into a fresh fp32 buffer (cast at the end when the gradient is 16-bit).
absl::Status AllocateOutputs(CallBuffers& m, const LossProblem& p, const LossOutputs& out,
                             DeviceLossArgs* a, DeviceOutputs* d_out);

// Queues, after the engine's work on the same stream, the copies of the results back to the
// host (into `host` and the caller's outputs), the casts of a 16-bit dW and db, and the
// non-finite checks of the final outputs with their flag word. `streamed`: dX came down chunk
// by chunk already (StreamedChunkHooks::DxEnqueued).
absl::Status DownloadResults(CallBuffers& m, const LossProblem& p, const LossOutputs& out,
                             const DeviceLossArgs& a, const DeviceOutputs& d_out, bool streamed,
                             HostRows* host);

// The losses, lse, predictions, accuracy and token count from the per-row statistics:
// reductions on the host, in double and in row order (deterministic and exact enough).
void WriteHostOutputs(const LossProblem& p, const LossOutputs& out, const TargetSummary& s,
                      const std::vector<int32_t>& targets32,  // (BT) -1 for ignored rows
                      const HostRows& host);

}  // namespace cuda
}  // namespace lossd

#endif  // LOSSD_KERNELS_CUDA_DEVICE_IO_H_
