// Host <-> device copies of large pageable host buffers through a small pinned (page-locked)
// staging area, two slots deep, so the CPU copy of one slot overlaps the DMA of the other.
// Pageable copies through the driver reach only a few GB/s. One caller at a time; never
// allocates beyond its fixed staging area.
#ifndef LOSSD_KERNELS_CUDA_PINNED_STAGING_H_
#define LOSSD_KERNELS_CUDA_PINNED_STAGING_H_

#include <cuda_runtime_api.h>

#include <array>
#include <cstddef>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace lossd {
namespace cuda {

class PinnedStaging {
 public:
  static constexpr size_t kSlotBytes = size_t{16} << 20;

  // Allocates 2 x kSlotBytes of pinned host memory (current device's context).
  static absl::StatusOr<std::unique_ptr<PinnedStaging>> Create();
  ~PinnedStaging();
  PinnedStaging(const PinnedStaging&) = delete;
  PinnedStaging& operator=(const PinnedStaging&) = delete;

  // Copies n bytes host -> device in stream order on `stream`. Returns once the host buffer
  // may be reused (the last DMA may still be in flight; later work on `stream` sees the data).
  absl::Status Upload(void* device_dst,      // (n) bytes, device
                      const void* host_src,  // (n) bytes, pageable host
                      size_t n, cudaStream_t stream);

  // Copies n bytes device -> host after the work already queued on `stream`; returns once
  // every byte is in host_dst.
  absl::Status Download(void* host_dst,          // (n) bytes, pageable host
                        const void* device_src,  // (n) bytes, device
                        size_t n, cudaStream_t stream);

 private:
  PinnedStaging() = default;
  char* pinned_ = nullptr;             // (2, kSlotBytes)
  std::array<cudaEvent_t, 2> done_{};  // the last DMA through each slot
};

}  // namespace cuda
}  // namespace lossd

#endif  // LOSSD_KERNELS_CUDA_PINNED_STAGING_H_
