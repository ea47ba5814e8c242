// SPDX-License-Identifier: Apache-2.0
// CudaBackend's memory: device buffers from the stream-ordered pool, counted against the
// budget (AllocateDevice), the copies and zeroing of Backend's buffer interface, and pinned
// host memory for the engine's buffers.
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "core/status_macros.h"
#include "kernels/backend.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/device_io.h"

namespace lossd {
namespace cuda {
namespace {

constexpr uint64_t kMinAllocation = 256;

// Device memory from the device's stream-ordered pool. Whoever destroys a buffer has made
// sure no device work still uses it (a Compute waits for its streams, or for the device on an
// error path; weights and accumulators are released only after the Computes that hold them),
// so the free is queued on the allocation stream, which has no work: the memory goes back to
// the pool at once, without cudaFree's wait for the whole device (which stalled other
// clients' Computes: a 2 GiB accumulator drop took 100 ms under load).
class DeviceBuffer : public BackendBuffer {
 public:
  DeviceBuffer(void* ptr, size_t bytes, size_t counted, int device, cudaStream_t free_stream,
               std::shared_ptr<MemoryCounters> counters)
      : ptr_(ptr), bytes_(bytes), counted_(counted), device_(device), free_stream_(free_stream),
        counters_(std::move(counters)) {}
  ~DeviceBuffer() override {
    // Errors here have no caller to go to.
    cudaSetDevice(device_);
    cudaFreeAsync(ptr_, free_stream_);
    counters_->current -= counted_;
  }
  void* data() override { return ptr_; }
  size_t size() const override { return bytes_; }
  const void* cdata() const { return ptr_; }

 private:
  void* ptr_;
  size_t bytes_;
  size_t counted_;
  int device_;
  cudaStream_t free_stream_;
  std::shared_ptr<MemoryCounters> counters_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<BackendBuffer>> CudaBackend::AllocateDevice(size_t bytes) {
  // After a sticky error every CUDA call fails with it: say so at once, as UNAVAILABLE (a
  // client should go to another replica), rather than make the call and report INTERNAL.
  if (!healthy_) return Unhealthy("allocation");
  const uint64_t counted = Align(bytes < kMinAllocation ? kMinAllocation : bytes);
  // Counted before the allocation, by compare-and-swap: weight uploads and accumulators
  // allocate beside a Compute's buffers, and two threads that both read `held` and then
  // allocated could together pass the budget.
  uint64_t held = counters_->current.load();
  do {
    if (options_.memory_budget_bytes != 0 && held + counted > options_.memory_budget_bytes) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "cuda: allocating ", bytes, " bytes would exceed the memory budget of ",
          options_.memory_budget_bytes, " bytes (", held, " held)"));
    }
  } while (!counters_->current.compare_exchange_weak(held, held + counted));
  cudaError_t e = cudaSetDevice(options_.device);
  if (e != cudaSuccess) {
    counters_->current -= counted;
    return CudaStatus(e, "cudaSetDevice");
  }
  void* ptr = nullptr;
  e = cudaMallocAsync(&ptr, counted, alloc_stream_);
  if (e == cudaErrorMemoryAllocation) {
    // The pool keeps freed memory for reuse; hand it back to the device and try once more.
    cudaGetLastError();
    cudaMemPool_t pool = nullptr;
    if (cudaDeviceGetDefaultMemPool(&pool, options_.device) == cudaSuccess) {
      cudaStreamSynchronize(alloc_stream_);
      cudaMemPoolTrimTo(pool, 0);
    }
    cudaGetLastError();
    e = cudaMallocAsync(&ptr, counted, alloc_stream_);
  }
  // Usable from every stream once the allocation stream has passed it.
  if (e == cudaSuccess) {
    e = cudaStreamSynchronize(alloc_stream_);
    if (e != cudaSuccess) cudaFreeAsync(ptr, alloc_stream_);  // best effort: the device failed
  }
  if (e != cudaSuccess) {
    counters_->current -= counted;
    cudaGetLastError();  // out-of-memory is not sticky: clear it and keep serving
    size_t free_bytes = 0, total_bytes = 0;
    cudaMemGetInfo(&free_bytes, &total_bytes);
    cudaGetLastError();
    if (e == cudaErrorMemoryAllocation) {
      return absl::ResourceExhaustedError(
          absl::StrCat("cuda: cudaMallocAsync(", counted, " bytes) on ", device_name_,
                       ": out of memory (", free_bytes, " of ", total_bytes, " bytes free)"));
    }
    // A device fault shows here too when only uploads arrive: health must say so.
    if (IsStickyCudaError(e)) healthy_ = false;
    return CudaStatus(e, absl::StrCat("cudaMallocAsync(", counted, " bytes)"));
  }
  const uint64_t now = held + counted;
  uint64_t peak = counters_->peak.load();
  while (now > peak && !counters_->peak.compare_exchange_weak(peak, now)) {
  }
  return std::unique_ptr<BackendBuffer>(
      new DeviceBuffer(ptr, bytes, counted, options_.device, alloc_stream_, counters_));
}

absl::StatusOr<std::unique_ptr<BackendBuffer>> CudaBackend::Allocate(size_t bytes) {
  return AllocateDevice(bytes);
}

absl::Status CudaBackend::CopyToBackend(BackendBuffer& dst, size_t offset, const void* src,
                                        size_t bytes) {
  if (offset > dst.size() || bytes > dst.size() - offset) {
    return absl::OutOfRangeError(absl::StrCat("cuda: copy of ", bytes, " bytes at offset ",
                                              offset, " overruns a buffer of ", dst.size()));
  }
  if (bytes == 0) return absl::OkStatus();
  if (!healthy_) return Unhealthy("copy to the device");
  LOSSD_CUDA_RETURN_IF_ERROR(cudaSetDevice(options_.device));
  LOSSD_RETURN_IF_ERROR(Check(CudaStatus(
      cudaMemcpy(static_cast<char*>(dst.data()) + offset, src, bytes, cudaMemcpyHostToDevice),
      "cudaMemcpy(host to device)")));
  // From pageable memory cudaMemcpy may return before the data has landed, and Compute runs
  // on non-blocking streams that do not wait for the default stream: wait here.
  return Check(CudaStatus(cudaStreamSynchronize(cudaStreamLegacy),
                          "cudaStreamSynchronize(after host to device)"));
}

absl::Status CudaBackend::CopyFromBackend(const BackendBuffer& src, size_t offset, void* dst,
                                          size_t bytes) {
  if (offset > src.size() || bytes > src.size() - offset) {
    return absl::OutOfRangeError(absl::StrCat("cuda: copy of ", bytes, " bytes at offset ",
                                              offset, " overruns a buffer of ", src.size()));
  }
  if (bytes == 0) return absl::OkStatus();
  if (!healthy_) return Unhealthy("copy from the device");
  LOSSD_CUDA_RETURN_IF_ERROR(cudaSetDevice(options_.device));
  const char* from = static_cast<const char*>(const_cast<BackendBuffer&>(src).data()) + offset;
  return Check(CudaStatus(cudaMemcpy(dst, from, bytes, cudaMemcpyDeviceToHost),
                          "cudaMemcpy(device to host)"));
}

absl::Status CudaBackend::Zero(BackendBuffer& buf) {
  if (!healthy_) return Unhealthy("zeroing a buffer");
  LOSSD_CUDA_RETURN_IF_ERROR(cudaSetDevice(options_.device));
  LOSSD_RETURN_IF_ERROR(
      Check(CudaStatus(cudaMemset(buf.data(), 0, buf.size()), "cudaMemset")));
  // cudaMemset is asynchronous; Compute's non-blocking streams would not wait for it.
  return Check(
      CudaStatus(cudaStreamSynchronize(cudaStreamLegacy), "cudaStreamSynchronize(after memset)"));
}

namespace {

// Pinned host memory for the engine's request and response buffers. Never destroyed: buffers
// from it may outlive every backend (they go back to the engine's pool first).
class PinnedHostMemory : public HostMemory {
 public:
  explicit PinnedHostMemory(int device) : device_(device) {}
  void* Allocate(size_t bytes) override {
    void* p = nullptr;
    // Any thread may ask: make this backend's device current for it first.
    if (cudaSetDevice(device_) != cudaSuccess ||
        cudaHostAlloc(&p, bytes, cudaHostAllocPortable) != cudaSuccess) {
      cudaGetLastError();  // not sticky: ordinary memory serves instead
      return nullptr;
    }
    return p;
  }
  void Free(void* p) override { cudaFreeHost(p); }

 private:
  const int device_;
};

}  // namespace

HostMemory* CudaBackend::host_memory() {
  static PinnedHostMemory* memory = new PinnedHostMemory(options_.device);
  return memory;
}

}  // namespace cuda
}  // namespace lossd
