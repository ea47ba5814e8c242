#include "kernels/cuda/cuda_backend.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "kernels/cuda/ce_kernels.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/fused_loss.h"
#include "kernels/cuda/nonfinite.h"
#include "core/dtype.h"
#include "core/loss_problem.h"
#include "core/loss_problem_check.h"
#include "core/status_macros.h"

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

uint64_t Align(uint64_t x) { return (x + 255) / 256 * 256; }

// Device bytes one Compute allocates, and the part of them that is workspace (not a device
// copy of an input or an output).
struct DevicePlan {
  uint64_t total = 0;
  uint64_t extra = 0;
};

DevicePlan PlanDeviceBytes(const WorkspaceShape& s, const ChunkPlan& plan) {
  const uint64_t bt = static_cast<uint64_t>(s.bt), h = static_cast<uint64_t>(s.h),
                 v = static_cast<uint64_t>(s.v);
  const uint64_t elem = DTypeSize(s.dtype), g = DTypeSize(s.grad_dtype);
  DevicePlan d;
  d.total += Align(bt * h * elem);                       // x
  if (s.w_memory == Memory::kHost) {
    d.total += Align(v * h * elem);                      // w
    if (s.has_bias) d.total += Align(v * elem);          // bias
  }
  d.total += Align(bt * 4);                              // targets
  if (s.has_class_weights) d.total += Align(v * 4);
  if (s.has_grad_output) d.total += Align(bt * 4);
  d.total += 4 * Align(bt * 4) + Align(4);               // per-row statistics, flags
  if (s.want_dx) d.total += Align(bt * h * g);
  if (s.dw == GradOut::kAccumulated) {
    if (s.accum_memory == Memory::kHost) d.total += Align(v * h * 4);
  } else if (s.dw == GradOut::kWritten) {
    d.total += Align(v * h * 4);
    if (s.grad_dtype != DType::kF32) {
      d.total += Align(v * h * g);
      d.extra += Align(v * h * 4);  // the fp32 accumulator behind a 16-bit dW
    }
  }
  if (s.has_bias) {
    if (s.db == GradOut::kAccumulated) {
      if (s.accum_memory == Memory::kHost) d.total += Align(v * 4);
    } else if (s.db == GradOut::kWritten) {
      d.total += 2 * Align(v * 4);
    }
  }
  d.total += plan.workspace_bytes;
  d.extra += plan.workspace_bytes;
  return d;
}

int32_t Elem(DType t) { return static_cast<int32_t>(t); }

// The outputs' final device copies, for the non-finite check: dX, then dW and db as they are
// returned (cast to the gradient dtype where they are) or as the accumulator holds them.
struct FinalOutputs {
  const void* dx = nullptr;
  const void* dw = nullptr;
  const void* db = nullptr;
  int32_t dx_elem = 0, dw_elem = 0, db_elem = 0;
};

// Queues one read of each final output on `stream`, after the Compute's writes; *flags (device,
// zeroed here) gets LossStats' NonFiniteBits.
absl::Status EnqueueNonFiniteChecks(const FinalOutputs& f, int64_t bt, int64_t h, int64_t v,
                                    uint32_t* flags, cudaStream_t stream) {
  LOSSD_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(flags, 0, 4, stream));
  if (f.dx != nullptr) {
    LOSSD_CUDA_RETURN_IF_ERROR(
        LaunchNonFiniteCheck(f.dx, f.dx_elem, bt * h, kNonFiniteDx, flags, stream));
  }
  if (f.dw != nullptr) {
    LOSSD_CUDA_RETURN_IF_ERROR(
        LaunchNonFiniteCheck(f.dw, f.dw_elem, v * h, kNonFiniteDw, flags, stream));
  }
  if (f.db != nullptr) {
    LOSSD_CUDA_RETURN_IF_ERROR(
        LaunchNonFiniteCheck(f.db, f.db_elem, v, kNonFiniteDb, flags, stream));
  }
  return absl::OkStatus();
}

// What this backend cannot do with a valid problem (core/loss_problem_check.h, which the
// engine ran): its kernels index rows, columns and classes with 32-bit integers.
absl::Status CheckIndexRange(const LossProblem& p) {
  if (p.bt > 0x7fffffff || p.v > 0x7fffffff || p.h > 0x7fffffff) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cuda: shape must have 0 <= bt, 0 < h, 0 < v, each below 2^31; got bt=", p.bt,
        " h=", p.h, " v=", p.v));
  }
  return absl::OkStatus();
}

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

  absl::StatusOr<cudaEvent_t> XReady(int64_t row0, int64_t row1) override {
    LOSSD_RETURN_IF_ERROR(rows_->WaitX(row1));
    if (row1 <= uploaded_) return nullptr;
    if (uploaded_ == 0) {
      // The first rows go up after everything main_ holds so far: the zero fill of X and the
      // autotuning trials that read it (fused_loss.cc, the tuning pass), so neither a trial
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

  absl::Status DxEnqueued(int64_t row0, int64_t row1, cudaStream_t stream) override {
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

  // Waits until every copy and host function queued here has run.
  absl::Status Finish() {
    LOSSD_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(s_.x));
    LOSSD_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(s_.dx));
    return absl::OkStatus();
  }

 private:
  struct Note {
    RowStream* rows;
    int64_t ready;
  };
  // On the runtime's callback thread: must not call into CUDA (DxReady does not).
  static void CUDART_CB Notify(void* arg) {
    const Note* note = static_cast<const Note*>(arg);
    note->rows->DxReady(note->ready);
  }

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

}  // namespace

CudaBackend::CudaBackend(const CudaBackendOptions& options)
    : options_(options), counters_(std::make_shared<MemoryCounters>()) {}

CudaBackend::~CudaBackend() {
  absl::MutexLock lock(&mu_);
  engine_.reset();
  // Teardown errors have no caller to go to.
  cudaSetDevice(options_.device);
  // The allocation stream outlives a backend that was made (its buffers may outlive it and
  // free on it), but not one whose Create failed: no buffer exists yet.
  if (!created_ && alloc_stream_ != nullptr) cudaStreamDestroy(alloc_stream_);
  for (cudaEvent_t e : {x_start_, x_copied_, dx_done_}) {
    if (e != nullptr) cudaEventDestroy(e);
  }
  for (cudaStream_t st : {x_stream_, dx_stream_}) {
    if (st != nullptr) cudaStreamDestroy(st);
  }
}

absl::StatusOr<std::unique_ptr<CudaBackend>> CudaBackend::Create(
    const CudaBackendOptions& options) {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (IsNoGpuError(e) || (e == cudaSuccess && count == 0)) {
    return absl::UnavailableError(absl::StrCat(
        "no GPU: cudaGetDeviceCount: ",
        e == cudaSuccess ? "no CUDA device" : cudaGetErrorString(e)));
  }
  LOSSD_CUDA_RETURN_IF_ERROR(e);
  if (options.device < 0 || options.device >= count) {
    return absl::InvalidArgumentError(absl::StrCat("cuda: device ", options.device,
                                                   " does not exist; there are ", count));
  }
  std::unique_ptr<CudaBackend> b(new CudaBackend(options));
  cudaDeviceProp prop;
  LOSSD_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, options.device));
  b->device_name_ = prop.name;
  LOSSD_CUDA_RETURN_IF_ERROR(cudaSetDevice(options.device));
  // Freed memory stays in the device's pool for the next Compute (trimmed when an allocation
  // would fail), instead of going back to the driver at every synchronisation.
  cudaMemPool_t pool = nullptr;
  LOSSD_CUDA_RETURN_IF_ERROR(cudaDeviceGetDefaultMemPool(&pool, options.device));
  uint64_t keep = UINT64_MAX;
  LOSSD_CUDA_RETURN_IF_ERROR(
      cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep));
  LOSSD_CUDA_RETURN_IF_ERROR(
      cudaStreamCreateWithFlags(&b->alloc_stream_, cudaStreamNonBlocking));
  absl::StatusOr<std::unique_ptr<FusedLoss>> engine = FusedLoss::Create(options.device);
  if (!engine.ok()) return engine.status();
  (*engine)->set_autotune(options.autotune_gemms);
  absl::MutexLock lock(&b->mu_);
  b->engine_ = *std::move(engine);
  // Non-blocking: the copies must not wait for (or hold up) work on the legacy default stream.
  LOSSD_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&b->x_stream_, cudaStreamNonBlocking));
  LOSSD_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&b->dx_stream_, cudaStreamNonBlocking));
  for (cudaEvent_t* e : {&b->x_start_, &b->x_copied_, &b->dx_done_}) {
    LOSSD_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(e, cudaEventDisableTiming));
  }
  b->created_ = true;
  return b;
}

BackendInfo CudaBackend::Info() {
  BackendInfo info;
  info.name = "cuda";
  info.device = device_name_;
  size_t free_bytes = 0, total_bytes = 0;
  if (cudaSetDevice(options_.device) == cudaSuccess &&
      cudaMemGetInfo(&free_bytes, &total_bytes) == cudaSuccess) {
    info.memory_total_bytes = total_bytes;
    info.memory_used_bytes = total_bytes - free_bytes;
  } else {
    cudaGetLastError();  // a failed query is reported as zeros, not left pending
  }
  info.memory_peak_bytes = counters_->peak.load();
  info.memory_held_bytes = counters_->current.load();
  info.memory_budget_bytes = options_.memory_budget_bytes;
  info.healthy = healthy_.load();
  return info;
}

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

ChunkPlan CudaBackend::Plan(const WorkspaceShape& s) const {
  const uint64_t budget = options_.chunk_budget_bytes != 0
                              ? options_.chunk_budget_bytes
                              : DefaultChunkBudget(s.bt, s.v, s.dtype);
  // A fresh dW (not an accumulator) lends its memory to the logits: no fp32 re-reads. Not
  // with rows still arriving: every whole-batch GEMM reads all of X.
  if (options_.whole_batch && s.chunk_rows == 0 && s.dw == GradOut::kWritten &&
      !s.rows_streamed) {
    ChunkPlan whole = PlanWhole(s.bt, s.h, s.v, s.dtype, s.want_dx, s.grad_dtype, budget);
    if (whole.blocks > 0) return whole;
  }
  ChunkPlan plan =
      PlanChunks(s.bt, s.v, s.dtype, budget, s.chunk_rows, options_.schedule);
  if (options_.auto_schedule && s.dw == GradOut::kNone) {
    plan.schedule = Schedule::kRowHalves;  // no dW to overlap
  } else if (options_.auto_schedule) {
    // Short chunks re-read the fp32 dW often; the column halves hide part of that traffic
    // under the next chunk's logits GEMM. Long chunks gain more from the row halves' CE
    // overlap (bench/RESULTS.md: columns won at C = 1024, rows at C >= 2048).
    plan.schedule = plan.chunk_rows < 2048 && plan.chunk_rows < s.bt ? Schedule::kColumnHalves
                                                                      : Schedule::kRowHalves;
  }
  plan.side_sms = options_.side_sms;
  return plan;
}

uint64_t CudaBackend::WorkspaceBytes(const WorkspaceShape& shape) {
  return PlanDeviceBytes(shape, Plan(shape)).total;
}

absl::Status CudaBackend::Check(absl::Status s) {
  if (s.ok()) return s;
  if (absl::IsResourceExhausted(s) || absl::IsInvalidArgument(s) || absl::IsOutOfRange(s)) {
    // Not a device fault (a refused request, or out of memory), but a failed allocation or
    // launch leaves its error pending on this thread: cleared here, or the next request's
    // first cudaGetLastError would report it and fail a request that did nothing wrong.
    cudaGetLastError();
    if (absl::IsResourceExhausted(s)) {
      // Out of memory, perhaps outside the pool (a kernel loaded at its first launch, a
      // cuBLASLt workspace), which the pool may hold all of: give its unused memory back,
      // or the same request would fail the same way every time.
      cudaMemPool_t pool = nullptr;
      if (cudaDeviceGetDefaultMemPool(&pool, options_.device) == cudaSuccess) {
        cudaMemPoolTrimTo(pool, 0);
      }
      cudaGetLastError();
    }
    return s;
  }
  // Anything else may have come from a device fault: a sticky error shows on every call.
  const cudaError_t e = cudaDeviceSynchronize();
  if (IsStickyCudaError(e)) {
    healthy_ = false;
    return absl::InternalError(absl::StrCat(s.message(), "; the device is in a sticky error ",
                                            "state (", cudaGetErrorName(e), ")"));
  }
  cudaGetLastError();
  return s;
}

absl::Status CudaBackend::Unhealthy(absl::string_view call) const {
  return absl::UnavailableError(absl::StrCat(
      "cuda: ", call, " refused: the device hit a sticky error earlier; this backend can no "
      "longer serve (the process must restart)"));
}

absl::Status CudaBackend::Compute(const LossProblem& p, const LossOutputs& out,
                                  LossStats* stats) {
  absl::MutexLock lock(&mu_);
  if (!healthy_) return Unhealthy("Compute");
  return Check(ComputeLocked(p, out, stats));
}

absl::Status CudaBackend::ComputeLocked(const LossProblem& p, const LossOutputs& out,
                                        LossStats* stats) {
  const auto t0 = std::chrono::steady_clock::now();
  LOSSD_DCHECK_VALID_PROBLEM(p, &out, "cuda backend");
  LOSSD_RETURN_IF_ERROR(CheckIndexRange(p));
  std::vector<int32_t> targets32;
  absl::StatusOr<TargetSummary> summary =
      SummarizeTargets(p.targets, p.target_dtype, p.bt, p.v, p.options.ignore_index,
                       p.class_weights, &targets32);
  if (!summary.ok()) return summary.status();
  const WorkspaceShape shape = ShapeOf(p, out);
  const ChunkPlan plan = Plan(shape);
  const DevicePlan bytes = PlanDeviceBytes(shape, plan);
  if (options_.memory_budget_bytes != 0 && bytes.total > options_.memory_budget_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "cuda: this problem needs ", bytes.total, " device bytes; the budget is ",
        options_.memory_budget_bytes));
  }

  const int64_t bt = p.bt, h = p.h, v = p.v;
  const size_t elem = DTypeSize(p.dtype), gsize = DTypeSize(out.grad_dtype);
  const bool none = p.options.reduction == Reduction::kNone;
  cudaStream_t stream = engine_->stream();
  LOSSD_CUDA_RETURN_IF_ERROR(cudaSetDevice(options_.device));

  // The overlapped path's hooks, when p.rows is set, and the host vectors the results are
  // copied into: declared before `drain`, so that the host functions and copies queued for
  // them have run (the device drained) before they go.
  std::optional<StreamedChunkHooks> streamed;
  std::vector<float> lse(bt), ce(bt), zl(bt);
  std::vector<int32_t> pred(bt);
  uint32_t nonfinite = 0;
  // Every buffer lives until the end of this call. On an error path work may still be queued
  // on the engine's streams (and, overlapped, on the copy streams, host functions included):
  // wait for the device before the buffers go back to the pool (declared after `held`, so it
  // runs first).
  std::vector<std::unique_ptr<BackendBuffer>> held;
  struct DrainOnError {
    bool done = false;
    ~DrainOnError() {
      if (!done) cudaDeviceSynchronize();
    }
  } drain;
  auto alloc = [&](uint64_t n) -> absl::StatusOr<void*> {
    absl::StatusOr<std::unique_ptr<BackendBuffer>> b = AllocateDevice(n);
    if (!b.ok()) return b.status();
    held.push_back(*std::move(b));
    return held.back()->data();
  };
  auto upload = [&](const void* src, uint64_t n, void** dst) -> absl::Status {
    absl::StatusOr<void*> d = alloc(n);
    if (!d.ok()) return d.status();
    *dst = *d;
    if (n == 0) return absl::OkStatus();
    return CudaStatus(cudaMemcpyAsync(*dst, src, n, cudaMemcpyHostToDevice, stream),
                      "cudaMemcpyAsync(host to device)");
  };

  DeviceLossArgs a;
  a.bt = bt;
  a.h = h;
  a.v = v;
  a.dtype = p.dtype;
  a.options = p.options;
  a.summary = *summary;
  if (p.options.reduction == Reduction::kNone && p.grad_output != nullptr) {
    for (int64_t i = 0; i < bt; ++i) {
      a.summary.row_grad_max_abs =
          std::max(a.summary.row_grad_max_abs, std::fabs(static_cast<double>(p.grad_output[i])));
    }
  }
  void* ptr = nullptr;
  void* x_device = nullptr;  // (BT, H) input dtype; written by StreamedChunkHooks when overlapped
  if (p.rows == nullptr) {
    LOSSD_RETURN_IF_ERROR(upload(p.x, bt * h * elem, &ptr));
  } else {
    // Rows go up as they arrive (StreamedChunkHooks). Until then X holds zeros, not the pool's
    // leftovers: the autotuning trials read it, and their X^T 0 must be 0 (fused_loss.cc).
    absl::StatusOr<void*> d = alloc(bt * h * elem);
    if (!d.ok()) return d.status();
    ptr = x_device = *d;
    if (bt > 0) {
      LOSSD_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(ptr, 0, bt * h * elem, stream));
    }
  }
  a.x = ptr;
  if (p.w_memory == Memory::kHost) {
    LOSSD_RETURN_IF_ERROR(upload(p.w, v * h * elem, &ptr));
    a.w = ptr;
    if (p.bias != nullptr) {
      LOSSD_RETURN_IF_ERROR(upload(p.bias, v * elem, &ptr));
      a.bias = ptr;
    }
  } else {
    a.w = p.w;
    a.bias = p.bias;
  }
  LOSSD_RETURN_IF_ERROR(upload(targets32.data(), bt * 4, &ptr));
  a.targets = static_cast<const int32_t*>(ptr);
  if (p.class_weights != nullptr) {
    LOSSD_RETURN_IF_ERROR(upload(p.class_weights, v * 4, &ptr));
    a.class_weights = static_cast<const float*>(ptr);
  }
  if (p.grad_output != nullptr) {
    LOSSD_RETURN_IF_ERROR(upload(p.grad_output, bt * 4, &ptr));
    a.row_grad = static_cast<const float*>(ptr);
  }
  // The per-row statistics, and the non-finite check's flag word after them.
  absl::StatusOr<void*> rows_mem = alloc(4 * Align(bt * 4) + Align(4));
  if (!rows_mem.ok()) return rows_mem.status();
  char* rows_base = static_cast<char*>(*rows_mem);
  a.row_lse = reinterpret_cast<float*>(rows_base);
  a.row_ce = reinterpret_cast<float*>(rows_base + Align(bt * 4));
  a.row_z = reinterpret_cast<float*>(rows_base + 2 * Align(bt * 4));
  a.row_pred = reinterpret_cast<int32_t*>(rows_base + 3 * Align(bt * 4));
  if (out.dx != nullptr) {
    absl::StatusOr<void*> d = alloc(bt * h * gsize);
    if (!d.ok()) return d.status();
    a.dx = *d;
    a.dx_dtype = out.grad_dtype;
  }
  // dW: straight into a device accumulator, through a device copy of a host accumulator, or
  // into a fresh fp32 buffer (cast at the end when the gradient is 16-bit).
  void* dw_cast = nullptr;
  if (out.dw_accum != nullptr) {
    a.accumulate_dw = true;
    if (out.accum_memory == Memory::kBackend) {
      a.dw_acc = out.dw_accum;
    } else {
      LOSSD_RETURN_IF_ERROR(upload(out.dw_accum, v * h * 4, &ptr));
      a.dw_acc = static_cast<float*>(ptr);
    }
  } else if (out.dw != nullptr) {
    absl::StatusOr<void*> d = alloc(v * h * 4);
    if (!d.ok()) return d.status();
    a.dw_acc = static_cast<float*>(*d);
    if (out.grad_dtype != DType::kF32) {
      absl::StatusOr<void*> c = alloc(v * h * gsize);
      if (!c.ok()) return c.status();
      dw_cast = *c;
    }
  }
  void* db_cast = nullptr;
  if (p.bias != nullptr) {
    if (out.db_accum != nullptr) {
      a.accumulate_db = true;
      if (out.accum_memory == Memory::kBackend) {
        a.db_acc = out.db_accum;
      } else {
        LOSSD_RETURN_IF_ERROR(upload(out.db_accum, v * 4, &ptr));
        a.db_acc = static_cast<float*>(ptr);
      }
    } else if (out.db != nullptr) {
      absl::StatusOr<void*> d = alloc(v * 4);
      if (!d.ok()) return d.status();
      a.db_acc = static_cast<float*>(*d);
      absl::StatusOr<void*> c = alloc(v * 4);
      if (!c.ok()) return c.status();
      db_cast = *c;
    }
  }
  absl::StatusOr<void*> workspace = alloc(plan.workspace_bytes);
  if (!workspace.ok()) return workspace.status();
  if (p.rows != nullptr) {
    StreamedChunkHooks::Streams s;
    s.main = stream;
    s.x = x_stream_;
    s.dx = dx_stream_;
    s.x_start = x_start_;
    s.x_copied = x_copied_;
    s.dx_done = dx_done_;
    streamed.emplace(p.rows, s, p.x, x_device, h * elem, out.dx, a.dx, h * gsize);
    a.hooks = &*streamed;
  }

  const int64_t tunings_before = engine_->tunings();
  LOSSD_RETURN_IF_ERROR(engine_->Enqueue(a, plan, *workspace));
  const int64_t tunings = engine_->tunings() - tunings_before;

  // Results back to the host, on the same stream (into the vectors declared before `drain`).
  auto download = [&](void* dst, const void* src, uint64_t n) -> absl::Status {
    if (n == 0) return absl::OkStatus();
    return CudaStatus(cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToHost, stream),
                      "cudaMemcpyAsync(device to host)");
  };
  LOSSD_RETURN_IF_ERROR(download(lse.data(), a.row_lse, bt * 4));
  LOSSD_RETURN_IF_ERROR(download(ce.data(), a.row_ce, bt * 4));
  LOSSD_RETURN_IF_ERROR(download(zl.data(), a.row_z, bt * 4));
  LOSSD_RETURN_IF_ERROR(download(pred.data(), a.row_pred, bt * 4));
  // Overlapped, dX came down chunk by chunk (StreamedChunkHooks::DxEnqueued).
  if (out.dx != nullptr && !streamed.has_value()) {
    LOSSD_RETURN_IF_ERROR(download(out.dx, a.dx, bt * h * gsize));
  }
  FinalOutputs final_out;
  final_out.dx = out.dx != nullptr ? a.dx : nullptr;
  final_out.dx_elem = Elem(out.grad_dtype);
  final_out.dw = a.dw_acc;  // fp32: the accumulator, or dW before its cast
  final_out.dw_elem = Elem(DType::kF32);
  final_out.db = a.db_acc;
  final_out.db_elem = Elem(DType::kF32);
  if (out.dw_accum != nullptr) {
    if (out.accum_memory == Memory::kHost) {
      LOSSD_RETURN_IF_ERROR(download(out.dw_accum, a.dw_acc, v * h * 4));
    }
  } else if (out.dw != nullptr) {
    if (dw_cast != nullptr) {
      LOSSD_CUDA_RETURN_IF_ERROR(
          LaunchCastFromFloat(a.dw_acc, dw_cast, Elem(out.grad_dtype), v * h, stream));
      final_out.dw = dw_cast;  // fp16 overflows where fp32 did not
      final_out.dw_elem = Elem(out.grad_dtype);
      LOSSD_RETURN_IF_ERROR(download(out.dw, dw_cast, v * h * gsize));
    } else {
      LOSSD_RETURN_IF_ERROR(download(out.dw, a.dw_acc, v * h * 4));
    }
  }
  if (p.bias != nullptr) {
    if (out.db_accum != nullptr) {
      if (out.accum_memory == Memory::kHost) {
        LOSSD_RETURN_IF_ERROR(download(out.db_accum, a.db_acc, v * 4));
      }
    } else if (out.db != nullptr) {
      LOSSD_CUDA_RETURN_IF_ERROR(
          LaunchCastFromFloat(a.db_acc, db_cast, Elem(out.grad_dtype), v, stream));
      final_out.db = db_cast;
      final_out.db_elem = Elem(out.grad_dtype);
      LOSSD_RETURN_IF_ERROR(download(out.db, db_cast, v * gsize));
    }
  }
  uint32_t* flags = reinterpret_cast<uint32_t*>(rows_base + 4 * Align(bt * 4));
  LOSSD_RETURN_IF_ERROR(EnqueueNonFiniteChecks(final_out, bt, h, v, flags, stream));
  LOSSD_RETURN_IF_ERROR(download(&nonfinite, flags, 4));
  LOSSD_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
  // main_ waited for every X copy, but the last dX copies and their host functions may trail.
  if (streamed.has_value()) LOSSD_RETURN_IF_ERROR(streamed->Finish());
  drain.done = true;  // everything the call queued has run

  // Reductions on the host, in double and in row order: deterministic and exact enough.
  const TargetSummary& s = *summary;
  double ce_total = 0, z_total = 0;
  int64_t correct = 0;
  for (int64_t i = 0; i < bt; ++i) {
    if (targets32[i] < 0) continue;
    ce_total += ce[i];
    z_total += zl[i];
    if (pred[i] == targets32[i]) ++correct;
  }
  double ce_loss = ce_total, z_loss = z_total;
  if (p.options.reduction == Reduction::kMean) {
    ce_loss = s.weight_sum != 0 ? ce_total / s.weight_sum : 0.0;
    z_loss = s.tokens != 0 ? z_total / static_cast<double>(s.tokens) : 0.0;
  }
  if (out.loss != nullptr) {
    if (none) {
      for (int64_t i = 0; i < bt; ++i) out.loss[i] = ce[i] + zl[i];
    } else {
      out.loss[0] = static_cast<float>(ce_loss + z_loss);
    }
  }
  if (out.z_loss != nullptr) {
    if (none) {
      for (int64_t i = 0; i < bt; ++i) out.z_loss[i] = zl[i];
    } else {
      out.z_loss[0] = static_cast<float>(z_loss);
    }
  }
  if (out.lse != nullptr) std::memcpy(out.lse, lse.data(), bt * sizeof(float));
  if (out.predictions != nullptr) {
    for (int64_t i = 0; i < bt; ++i) out.predictions[i] = pred[i];
  }
  if (out.accuracy != nullptr) {
    *out.accuracy = s.tokens != 0 ? static_cast<float>(static_cast<double>(correct) /
                                                       static_cast<double>(s.tokens))
                                  : 0.0f;
  }
  if (out.tokens != nullptr) *out.tokens = s.tokens;
  if (stats != nullptr) {
    stats->compute_seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    stats->peak_extra_bytes = bytes.extra;
    stats->chunk_rows = plan.chunk_rows;
    stats->gemm_tunings = tunings;
    stats->nonfinite = nonfinite;
  }
  return absl::OkStatus();
}

}  // namespace cuda
}  // namespace lossd
