// SPDX-License-Identifier: Apache-2.0
// The CUDA backend's hooks for the overlapped path (LossProblem::rows): X rows go up to the
// device as the RowStream releases them, and dX rows come down chunk by chunk, each on its own
// copy stream beside the engine's GEMMs. It never allocates device memory and never computes.
#ifndef LOSSD_KERNELS_CUDA_STREAMED_CHUNK_HOOKS_H_
#define LOSSD_KERNELS_CUDA_STREAMED_CHUNK_HOOKS_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <deque>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/loss_problem.h"
#include "kernels/cuda/fused_loss.h"

namespace lossd {
namespace cuda {

// The overlapped path's hooks (LossProblem::rows). X rows go up on x_stream as WaitX releases
// them; dX rows come down on dx_stream as soon as each chunk's dX GEMM is queued, and a host
// function queued behind the copy tells the RowStream. One object per Compute; it must outlive
// every host function it queued (ComputeLocked drains the device before it goes).
class StreamedChunkHooks : public ChunkHooks {
 public:
  struct Streams {
    cudaStream_t main = nullptr;  // the engine's stream: the zero fill of X and the trials
    cudaStream_t x = nullptr, dx = nullptr;
    cudaEvent_t x_start = nullptr, x_copied = nullptr, dx_done = nullptr;
  };
  StreamedChunkHooks(RowStream* rows, const Streams& s,
                     const void* host_x,  // (BT, H) input dtype, host; fills in as WaitX says
                     void* device_x,      // (BT, H) input dtype, device
                     size_t x_row_bytes,
                     void* host_dx,          // (BT, H) grad dtype, host, or null (no dX)
                     const void* device_dx,  // (BT, H) grad dtype, device, or null
                     size_t dx_row_bytes)
      : rows_(rows), s_(s), host_x_(static_cast<const char*>(host_x)),
        device_x_(static_cast<char*>(device_x)), x_row_bytes_(x_row_bytes),
        host_dx_(static_cast<char*>(host_dx)), device_dx_(static_cast<const char*>(device_dx)),
        dx_row_bytes_(dx_row_bytes) {}

  // Waits for the rows, then queues their copy on the X stream (the first behind main_).
  absl::StatusOr<cudaEvent_t> XReady(int64_t row0, int64_t row1) override;
  // Queues the rows' copy to the host behind the dX GEMM, then a host function that tells
  // the RowStream.
  absl::Status DxEnqueued(int64_t row0, int64_t row1, cudaStream_t stream) override;

  // Waits until every copy and host function queued here has run.
  absl::Status Finish();

 private:
  struct Note {
    RowStream* rows;
    int64_t ready;
  };
  // On the runtime's callback thread: must not call into CUDA (DxReady does not).
  static void CUDART_CB Notify(void* arg);

  RowStream* rows_;
  Streams s_;
  const char* host_x_;
  char* device_x_;
  size_t x_row_bytes_;
  char* host_dx_;
  const char* device_dx_;
  size_t dx_row_bytes_;
  int64_t uploaded_ = 0;  // rows [0, uploaded_) of X have their copies queued
  std::deque<Note> notes_;
};

}  // namespace cuda
}  // namespace lossd

#endif  // LOSSD_KERNELS_CUDA_STREAMED_CHUNK_HOOKS_H_
