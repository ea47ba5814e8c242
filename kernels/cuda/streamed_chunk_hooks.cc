// SPDX-License-Identifier: Apache-2.0
#include "kernels/cuda/streamed_chunk_hooks.h"

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/loss_problem.h"
#include "core/status_macros.h"
#include "kernels/cuda/cuda_status.h"

namespace lossd {
namespace cuda {

absl::StatusOr<cudaEvent_t> StreamedChunkHooks::XReady(int64_t row0, int64_t row1) {
  // Rows already copied were waited for: not asked again (a second pass over the chunks,
  // policy_sequence.h), so the RowStream sees non-decreasing WaitX calls.
  if (row1 <= uploaded_) return nullptr;
  LOSSD_RETURN_IF_ERROR(rows_->WaitX(row1));
  if (uploaded_ == 0) {
    // The first rows go up after everything main_ holds so far: the zero fill of X and the
    // autotuning trials that read it (fused_loss_chunks.cc, the tuning pass), so neither a trial
    // sees a half-copied X nor the fill lands over copied rows.
    LOSSD_CUDA_RETURN_IF_ERROR(cudaEventRecord(s_.x_start, s_.main));
    LOSSD_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(s_.x, s_.x_start, 0));
  }
  const size_t offset = static_cast<size_t>(uploaded_) * x_row_bytes_;
  LOSSD_RETURN_IF_ERROR(
      CudaStatus(cudaMemcpyAsync(device_x_ + offset, host_x_ + offset,
                                 static_cast<size_t>(row1 - uploaded_) * x_row_bytes_,
                                 cudaMemcpyHostToDevice, s_.x),
                 "cudaMemcpyAsync(X rows, host to device)"));
  uploaded_ = row1;
  // Re-recorded per chunk: Enqueue has queued main_'s wait on the previous recording
  // before it calls a hook again, and a wait holds the state the event had when queued.
  LOSSD_CUDA_RETURN_IF_ERROR(cudaEventRecord(s_.x_copied, s_.x));
  return s_.x_copied;
}

absl::Status StreamedChunkHooks::DxEnqueued(int64_t row0, int64_t row1,
                                            cudaStream_t stream) {
  if (host_dx_ == nullptr || row1 <= row0) return absl::OkStatus();
  LOSSD_CUDA_RETURN_IF_ERROR(cudaEventRecord(s_.dx_done, stream));
  LOSSD_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(s_.dx, s_.dx_done, 0));
  // Into pinned memory this runs beside the next chunk's GEMMs. Into pageable memory the
  // runtime stages it and returns only once it is done, so this thread waits for the
  // chunk's dX GEMM here (correct, but the next chunk is queued late).
  const size_t offset = static_cast<size_t>(row0) * dx_row_bytes_;
  LOSSD_RETURN_IF_ERROR(
      CudaStatus(cudaMemcpyAsync(host_dx_ + offset, device_dx_ + offset,
                                 static_cast<size_t>(row1 - row0) * dx_row_bytes_,
                                 cudaMemcpyDeviceToHost, s_.dx),
                 "cudaMemcpyAsync(dX rows, device to host)"));
  // The host function runs once the copy has landed; dx_stream_ runs them in queue order,
  // so the RowStream sees increasing rows. Its argument must stay put: a deque does not
  // move its elements as it grows.
  notes_.push_back(Note{rows_, row1});
  LOSSD_CUDA_RETURN_IF_ERROR(cudaLaunchHostFunc(s_.dx, &Notify, &notes_.back()));
  return absl::OkStatus();
}

absl::Status StreamedChunkHooks::Finish() {
  LOSSD_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(s_.x));
  LOSSD_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(s_.dx));
  return absl::OkStatus();
}

void CUDART_CB StreamedChunkHooks::Notify(void* arg) {
  const Note* note = static_cast<const Note*>(arg);
  note->rows->DxReady(note->ready);
}

}  // namespace cuda
}  // namespace lossd
