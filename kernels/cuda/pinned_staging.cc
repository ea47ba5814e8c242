#include "kernels/cuda/pinned_staging.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstring>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/cuda/cuda_status.h"

namespace lossd {
namespace cuda {

absl::StatusOr<std::unique_ptr<PinnedStaging>> PinnedStaging::Create() {
  std::unique_ptr<PinnedStaging> s(new PinnedStaging());
  void* p = nullptr;
  LOSSD_CUDA_RETURN_IF_ERROR(cudaHostAlloc(&p, 2 * kSlotBytes, cudaHostAllocDefault));
  s->pinned_ = static_cast<char*>(p);
  for (cudaEvent_t& e : s->done_) {
    LOSSD_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  }
  return s;
}

PinnedStaging::~PinnedStaging() {
  // Nothing may still be copying out of the slots when they are freed.
  for (cudaEvent_t e : done_) {
    if (e != nullptr) {
      cudaEventSynchronize(e);
      cudaEventDestroy(e);
    }
  }
  if (pinned_ != nullptr) cudaFreeHost(pinned_);
}

absl::Status PinnedStaging::Upload(void* device_dst, const void* host_src, size_t n,
                                   cudaStream_t stream) {
  const char* src = static_cast<const char*>(host_src);
  char* dst = static_cast<char*>(device_dst);
  for (size_t off = 0, i = 0; off < n; off += kSlotBytes, ++i) {
    const size_t len = std::min(kSlotBytes, n - off);
    char* slot = pinned_ + (i % 2) * kSlotBytes;
    // The slot's previous DMA must be done before the CPU overwrites it.
    LOSSD_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(done_[i % 2]));
    std::memcpy(slot, src + off, len);
    LOSSD_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(dst + off, slot, len, cudaMemcpyHostToDevice, stream));
    LOSSD_CUDA_RETURN_IF_ERROR(cudaEventRecord(done_[i % 2], stream));
  }
  return absl::OkStatus();
}

absl::Status PinnedStaging::Download(void* host_dst, const void* device_src, size_t n,
                                     cudaStream_t stream) {
  if (n == 0) return absl::OkStatus();
  char* dst = static_cast<char*>(host_dst);
  const char* src = static_cast<const char*>(device_src);
  const size_t pieces = (n + kSlotBytes - 1) / kSlotBytes;
  auto enqueue = [&](size_t i) -> absl::Status {
    const size_t off = i * kSlotBytes, len = std::min(kSlotBytes, n - off);
    LOSSD_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(pinned_ + (i % 2) * kSlotBytes, src + off, len,
                                               cudaMemcpyDeviceToHost, stream));
    LOSSD_CUDA_RETURN_IF_ERROR(cudaEventRecord(done_[i % 2], stream));
    return absl::OkStatus();
  };
  // Piece i+1's DMA runs while the CPU copies piece i out of the other slot.
  LOSSD_CUDA_RETURN_IF_NOT_OK(enqueue(0));
  for (size_t i = 0; i < pieces; ++i) {
    if (i + 1 < pieces) LOSSD_CUDA_RETURN_IF_NOT_OK(enqueue(i + 1));
    LOSSD_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(done_[i % 2]));
    const size_t off = i * kSlotBytes, len = std::min(kSlotBytes, n - off);
    std::memcpy(dst + off, pinned_ + (i % 2) * kSlotBytes, len);
  }
  return absl::OkStatus();
}

}  // namespace cuda
}  // namespace lossd
