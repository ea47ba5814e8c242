// SPDX-License-Identifier: Apache-2.0
#include "kernels/cuda/nccl_comm.h"

#include <cuda_runtime_api.h>
#include <dlfcn.h>

#include <chrono>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/call_once.h"
#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "kernels/backend.h"
#include "kernels/cuda/cuda_status.h"

namespace lossd {
namespace cuda {
namespace {

// Our own declarations of the little of NCCL's C API used here (its values as nccl.h of
// NCCL 2.14 and later defines them; enumerations cross as int, as C passes them).
using NcclResult = int;  // ncclResult_t
constexpr NcclResult kNcclSuccess = 0;
constexpr NcclResult kNcclInProgress = 7;  // a non-blocking call still running
constexpr int kNcclUint8 = 1;              // ncclDataType_t
constexpr int kNcclFloat32 = 7;
constexpr int kNcclSum = 0;  // ncclRedOp_t
constexpr int kNcclMinVersion = 21400;  // 2.14: ncclCommInitRankConfig, non-blocking mode
struct NcclCommOpaque;
using NcclCommHandle = NcclCommOpaque*;  // ncclComm_t
struct NcclId {                          // ncclUniqueId: opaque bytes, passed by value
  char bytes[kBackendCommIdBytes];
};
// The head of ncclConfig_t as NCCL 2.14 defined it. NCCL copies `size` bytes of a config over
// its own defaults and fills in every field newer than `version` itself, so this prefix is a
// complete config for every later NCCL; a longer struct of ours would tie us to one version.
struct NcclConfigHead {
  size_t size;
  unsigned int magic;    // NCCL's marker of an initialised config
  unsigned int version;  // the NCCL version whose fields the struct has
  int blocking;          // 0: init and collectives return ncclInProgress instead of waiting
};
constexpr unsigned int kNcclConfigMagic = 0xcafebeef;

// NCCL's functions, looked up once.
struct Nccl {
  NcclResult (*get_version)(int*);
  NcclResult (*get_unique_id)(NcclId*);
  NcclResult (*comm_init_rank_config)(NcclCommHandle*, int, NcclId, int, NcclConfigHead*);
  NcclResult (*comm_get_async_error)(NcclCommHandle, NcclResult*);
  NcclResult (*comm_abort)(NcclCommHandle);
  const char* (*get_error_string)(NcclResult);
  const char* (*get_last_error)(NcclCommHandle);  // null before NCCL 2.13
  NcclResult (*reduce_scatter)(const void*, void*, size_t, int, int, NcclCommHandle,
                               cudaStream_t);
  NcclResult (*all_reduce)(const void*, void*, size_t, int, int, NcclCommHandle, cudaStream_t);
  NcclResult (*all_gather)(const void*, void*, size_t, int, NcclCommHandle, cudaStream_t);
  NcclResult (*broadcast)(const void*, void*, size_t, int, int, NcclCommHandle, cudaStream_t);
  NcclResult (*group_start)();
  NcclResult (*group_end)();
  int version = 0;
};

template <typename Fn>
bool Find(void* lib, const char* name, Fn* fn, std::string* missing) {
  *fn = reinterpret_cast<Fn>(dlsym(lib, name));
  if (*fn == nullptr && missing->empty()) *missing = name;
  return *fn != nullptr;
}

std::string SetTheVariable() {
  return absl::StrCat("set ", kNcclLibraryEnv,
                      " to the path of libnccl.so.2 (NCCL 2.14 or newer; torch ships it in "
                      "site-packages/nvidia/nccl/lib)");
}

absl::Status OpenNccl(Nccl* n) {
  const std::string path = NcclLibraryPath();
  // RTLD_LOCAL: NCCL's symbols stay out of the process's global namespace.
  void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    const char* e = dlerror();
    return absl::FailedPreconditionError(
        absl::StrCat("nccl: head groups on the CUDA backend need NCCL: dlopen(", path,
                     "): ", e != nullptr ? e : "unknown error", "; ", SetTheVariable()));
  }
  std::string missing;
  Find(lib, "ncclGetVersion", &n->get_version, &missing);
  Find(lib, "ncclGetUniqueId", &n->get_unique_id, &missing);
  Find(lib, "ncclCommInitRankConfig", &n->comm_init_rank_config, &missing);
  Find(lib, "ncclCommGetAsyncError", &n->comm_get_async_error, &missing);
  Find(lib, "ncclCommAbort", &n->comm_abort, &missing);
  Find(lib, "ncclGetErrorString", &n->get_error_string, &missing);
  Find(lib, "ncclReduceScatter", &n->reduce_scatter, &missing);
  Find(lib, "ncclAllReduce", &n->all_reduce, &missing);
  Find(lib, "ncclAllGather", &n->all_gather, &missing);
  Find(lib, "ncclBroadcast", &n->broadcast, &missing);
  Find(lib, "ncclGroupStart", &n->group_start, &missing);
  Find(lib, "ncclGroupEnd", &n->group_end, &missing);
  n->get_last_error =
      reinterpret_cast<const char* (*)(NcclCommHandle)>(dlsym(lib, "ncclGetLastError"));
  if (!missing.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("nccl: ", path, " has no ", missing, "; ", SetTheVariable()));
  }
  if (n->get_version(&n->version) != kNcclSuccess || n->version < kNcclMinVersion) {
    return absl::FailedPreconditionError(absl::StrCat("nccl: ", path, " is NCCL version code ",
                                                      n->version, "; ", SetTheVariable()));
  }
  // Never dlclosed: communicators and NCCL's own threads live in it until the process ends.
  return absl::OkStatus();
}

// The process's NCCL, or why there is none (the same answer every time).
absl::StatusOr<const Nccl*> Loaded() {
  static absl::once_flag once;
  static Nccl* nccl = new Nccl();
  static absl::Status* status = new absl::Status();
  absl::call_once(once, [] { *status = OpenNccl(nccl); });
  if (!status->ok()) return *status;
  return nccl;
}

using Clock = std::chrono::steady_clock;

// Sleeps a little longer each time, up to 1 ms: short collectives end within microseconds,
// and a stalled one must not burn a core while it waits for its timeout.
class Backoff {
 public:
  void Wait() {
    std::this_thread::sleep_for(std::chrono::microseconds(us_));
    if (us_ < 1000) us_ *= 2;
  }

 private:
  int us_ = 10;
};

// NCCL's name for `r` and, where the communicator still exists, its last error's text.
std::string Describe(const Nccl& n, NcclResult r, NcclCommHandle comm) {
  std::string s = absl::StrCat(n.get_error_string(r), " (ncclResult ", r, ")");
  if (comm != nullptr && n.get_last_error != nullptr) {
    const char* last = n.get_last_error(comm);
    if (last != nullptr && *last != '\0') absl::StrAppend(&s, ": ", last);
  }
  return s;
}

// Member m's slice of n elements: [n * m / S, n * (m + 1) / S) (the engine's HeadSliceOf), in
// 128-bit arithmetic so that no n a buffer can hold overflows.
int64_t SliceStart(int64_t n, uint32_t m, uint32_t size) {
  return static_cast<int64_t>(static_cast<__int128>(n) * m / size);
}

class NcclComm final : public BackendComm {
 public:
  NcclComm(const Nccl* nccl, int device, NcclCommHandle comm, cudaStream_t stream,
           cudaEvent_t ready, uint32_t size, uint32_t rank, int64_t timeout_ms)
      : nccl_(*nccl), device_(device), stream_(stream), ready_(ready), size_(size),
        rank_(rank), timeout_ms_(timeout_ms), comm_(comm) {}
  ~NcclComm() override;

  absl::Status ReduceScatter(float* buf, int64_t n) override;
  absl::Status AllGather(void* buf, int64_t n, size_t elem_bytes) override;
  void Abort() override;

 private:
  // Checks that the communicator stands, and orders its stream after the buffers' producers.
  absl::Status Begin(const char* call) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Waits until what `call` enqueued has run, or fails and aborts (UNAVAILABLE).
  absl::Status Wait(const char* call);
  // Aborts with `why` unless aborted already; returns the UNAVAILABLE that `call` reports.
  absl::Status Fail(const char* call, const std::string& why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void AbortLocked(const std::string& why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // After an abort, waits (at most timeout_ms) for the stream, so the caller's buffer is not
  // written once the call has returned.
  void Drain();
  std::string Who() const {
    return absl::StrCat("member ", rank_, " of ", size_, " on device ", device_);
  }

  const Nccl& nccl_;
  const int device_;
  const cudaStream_t stream_;  // the collectives' own: nothing else runs on it
  const cudaEvent_t ready_;    // recorded on the legacy stream before each collective
  const uint32_t size_, rank_;
  const int64_t timeout_ms_;
  absl::Mutex call_mu_;  // one collective at a time, in the order the members agree on
  // Guards the handle: ncclCommAbort frees it, so no other call may use it meanwhile.
  absl::Mutex mu_ ABSL_ACQUIRED_AFTER(call_mu_);
  NcclCommHandle comm_ ABSL_GUARDED_BY(mu_);  // null once aborted
  std::string aborted_ ABSL_GUARDED_BY(mu_);  // why it was aborted; empty while it stands
};

absl::Status NcclComm::Begin(const char* call) {
  if (comm_ == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(
        "nccl: ", call, " refused: the head group's communicator (", Who(),
        ") was aborted: ", aborted_));
  }
  LOSSD_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  // The buffers' producers: the optimizer step, Zero and the copies run on the legacy default
  // stream (and return only once it has run them); a Compute's streams are synchronised
  // before the Compute returns. Our stream is non-blocking (so a stalled collective never
  // holds up the legacy stream's later work for other heads), so it does not wait for the
  // legacy stream by itself: this event orders it after everything queued there, without
  // stalling the host or the device's other streams as cudaDeviceSynchronize would.
  LOSSD_CUDA_RETURN_IF_ERROR(cudaEventRecord(ready_, cudaStreamLegacy));
  LOSSD_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(stream_, ready_, 0));
  return absl::OkStatus();
}

void NcclComm::AbortLocked(const std::string& why) {
  if (comm_ == nullptr) return;
  // Ends the kernels in flight (they return early) and frees the communicator.
  nccl_.comm_abort(comm_);
  comm_ = nullptr;
  aborted_ = why;
}

absl::Status NcclComm::Fail(const char* call, const std::string& why) {
  const bool first = comm_ != nullptr;
  AbortLocked(why);
  return absl::UnavailableError(absl::StrCat(
      "nccl: ", call, " failed (", Who(), "): ", first ? why : aborted_,
      "; the communicator is aborted and the buffer's contents are unspecified"));
}

absl::Status NcclComm::Wait(const char* call) {
  const Clock::time_point deadline = Clock::now() + std::chrono::milliseconds(timeout_ms_);
  Backoff backoff;
  absl::Status failed;
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      if (comm_ == nullptr) {  // Abort() from another thread
        failed = absl::UnavailableError(absl::StrCat("nccl: ", call, " ended (", Who(),
                                                     "): the communicator was aborted: ",
                                                     aborted_));
        break;
      }
      NcclResult async = kNcclSuccess;
      const NcclResult r = nccl_.comm_get_async_error(comm_, &async);
      if (r != kNcclSuccess || (async != kNcclSuccess && async != kNcclInProgress)) {
        const NcclResult bad = r != kNcclSuccess ? r : async;
        failed = Fail(call, absl::StrCat("NCCL reported ", Describe(nccl_, bad, comm_)));
        break;
      }
      // ncclInProgress: a non-blocking communicator may still be launching the kernels, so
      // the stream's state says nothing yet.
      if (async == kNcclSuccess) {
        const cudaError_t q = cudaStreamQuery(stream_);
        if (q == cudaSuccess) return absl::OkStatus();
        if (q != cudaErrorNotReady) {
          cudaGetLastError();
          failed = Fail(call, absl::StrCat("cudaStreamQuery: ", cudaGetErrorName(q), " (",
                                           cudaGetErrorString(q), ")"));
          break;
        }
      }
      if (Clock::now() >= deadline) {
        std::string last = Describe(nccl_, kNcclInProgress, comm_);
        failed = Fail(call, absl::StrCat("it did not finish within ", timeout_ms_,
                                         " ms (a member missing or stalled?); NCCL: ", last));
        break;
      }
    }
    backoff.Wait();
  }
  Drain();
  return failed;
}

void NcclComm::Drain() {
  const Clock::time_point deadline = Clock::now() + std::chrono::milliseconds(timeout_ms_);
  Backoff backoff;
  while (cudaStreamQuery(stream_) == cudaErrorNotReady && Clock::now() < deadline) {
    backoff.Wait();
  }
  cudaGetLastError();  // an abort's error is the collective's, reported already
}

absl::Status NcclComm::ReduceScatter(float* buf, int64_t n) {
  constexpr char kCall[] = "ReduceScatter";
  if (n < 0 || (n > 0 && buf == nullptr)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "nccl: ReduceScatter: needs n >= 0 fp32 elements in backend memory; got n=", n,
        buf == nullptr ? " and no buffer" : ""));
  }
  absl::MutexLock call(&call_mu_);
  {
    absl::MutexLock lock(&mu_);
    if (absl::Status st = Begin(kCall); !st.ok()) return st;
    if (n == 0) return absl::OkStatus();  // every member has the same n: none calls NCCL
    NcclResult r;
    if (n % size_ == 0) {
      // Uniform slices: NCCL's in-place reduce-scatter (recvbuff = sendbuff + rank * count).
      const size_t count = static_cast<size_t>(n / size_);
      r = nccl_.reduce_scatter(buf, buf + rank_ * count, count, kNcclFloat32, kNcclSum, comm_,
                               stream_);
    } else {
      // Slices of unequal sizes, which NCCL's reduce-scatter cannot express: an all-reduce of
      // the whole buffer, which leaves every slice summed (twice the bytes on the wire).
      r = nccl_.all_reduce(buf, buf, static_cast<size_t>(n), kNcclFloat32, kNcclSum, comm_,
                           stream_);
    }
    if (r != kNcclSuccess && r != kNcclInProgress) {
      return Fail(kCall, absl::StrCat("enqueueing it: ", Describe(nccl_, r, comm_)));
    }
  }
  return Wait(kCall);
}

absl::Status NcclComm::AllGather(void* buf, int64_t n, size_t elem_bytes) {
  constexpr char kCall[] = "AllGather";
  if (n < 0 || elem_bytes == 0 || (n > 0 && buf == nullptr) ||
      (n > 0 && static_cast<uint64_t>(n) > SIZE_MAX / elem_bytes)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "nccl: AllGather: needs n >= 0 elements of elem_bytes > 0 bytes in backend memory; "
        "got n=", n, " elem_bytes=", elem_bytes, buf == nullptr ? " and no buffer" : ""));
  }
  auto* bytes = static_cast<char*>(buf);
  absl::MutexLock call(&call_mu_);
  {
    absl::MutexLock lock(&mu_);
    if (absl::Status st = Begin(kCall); !st.ok()) return st;
    if (n == 0) return absl::OkStatus();
    NcclResult r = kNcclSuccess;
    if (n % size_ == 0) {
      // Uniform slices: NCCL's in-place all-gather (sendbuff = recvbuff + rank * count), by
      // bytes, so any element type gathers.
      const size_t count = static_cast<size_t>(n / size_) * elem_bytes;
      r = nccl_.all_gather(bytes + rank_ * count, bytes, count, kNcclUint8, comm_, stream_);
    } else {
      // Slices of unequal sizes: each member broadcasts its own, in one group so they run
      // together. Empty slices (n < S) are skipped by every member alike.
      r = nccl_.group_start();
      for (uint32_t m = 0; m < size_ && r == kNcclSuccess; ++m) {
        const int64_t begin = SliceStart(n, m, size_), end = SliceStart(n, m + 1, size_);
        if (end == begin) continue;
        char* slice = bytes + static_cast<size_t>(begin) * elem_bytes;
        r = nccl_.broadcast(slice, slice, static_cast<size_t>(end - begin) * elem_bytes,
                            kNcclUint8, static_cast<int>(m), comm_, stream_);
      }
      const NcclResult ended = nccl_.group_end();
      if (r == kNcclSuccess) r = ended;
    }
    if (r != kNcclSuccess && r != kNcclInProgress) {
      return Fail(kCall, absl::StrCat("enqueueing it: ", Describe(nccl_, r, comm_)));
    }
  }
  return Wait(kCall);
}

void NcclComm::Abort() {
  {
    absl::MutexLock lock(&mu_);
    AbortLocked("Abort() was called");
  }
}

NcclComm::~NcclComm() {
  {
    absl::MutexLock lock(&mu_);
    // Freed with ncclCommAbort, not ncclCommFinalize + ncclCommDestroy: finalize waits until
    // the whole communicator is quiescent, that is for every member's own finalize, and the
    // members of a group (separate processes) let go of it at different times, so one would
    // wait on the others for up to the timeout. Every collective here returns only once its
    // kernels have run, so nothing is in flight: the abort only frees, locally.
    cudaSetDevice(device_);
    AbortLocked("destroyed");
  }
  Drain();
  // Teardown errors have no caller to go to.
  cudaEventDestroy(ready_);
  cudaStreamDestroy(stream_);
}

absl::Status CheckConnect(const std::string& id, uint32_t size, uint32_t rank,
                          int64_t timeout_ms) {
  if (id.size() != kBackendCommIdBytes || size == 0 || size > INT_MAX || rank >= size ||
      timeout_ms <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "nccl: ConnectComm needs an id of ", kBackendCommIdBytes,
        " bytes (NewCommId's), 0 < size <= INT_MAX, rank < size and timeout_ms > 0; got an id "
        "of ", id.size(), " bytes, size ", size, ", rank ", rank, ", timeout_ms ", timeout_ms));
  }
  return absl::OkStatus();
}

// Waits for a non-blocking init to finish: NCCL's blocking init has no timeout (a member
// that never arrives leaves the others inside ncclCommInitRank for ever), so the
// communicator is made non-blocking and polled; past the deadline ncclCommAbort ends the
// half-formed one, which NCCL allows while it initialises.
absl::Status AwaitInit(const Nccl& n, NcclCommHandle comm, uint32_t size, uint32_t rank,
                       int64_t timeout_ms) {
  const Clock::time_point deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
  Backoff backoff;
  while (true) {
    NcclResult async = kNcclInProgress;
    const NcclResult r = n.comm_get_async_error(comm, &async);
    if (r == kNcclSuccess && async == kNcclSuccess) return absl::OkStatus();
    if (r != kNcclSuccess || async != kNcclInProgress) {
      const std::string why = Describe(n, r != kNcclSuccess ? r : async, comm);
      n.comm_abort(comm);
      return absl::UnavailableError(absl::StrCat("nccl: member ", rank, " of ", size,
                                                 " could not join the head group: ", why));
    }
    if (Clock::now() >= deadline) {
      n.comm_abort(comm);
      return absl::DeadlineExceededError(absl::StrCat(
          "nccl: member ", rank, " of ", size, ": the head group's members did not all join "
          "within ", timeout_ms, " ms (a member never connected?)"));
    }
    backoff.Wait();
  }
}

}  // namespace

std::string NcclLibraryPath() {
  const char* env = std::getenv(kNcclLibraryEnv);
  return env != nullptr && *env != '\0' ? std::string(env) : std::string(kNcclDefaultLibrary);
}

absl::Status NcclAvailable() { return Loaded().status(); }

absl::StatusOr<std::string> NcclNewCommId() {
  absl::StatusOr<const Nccl*> n = Loaded();
  if (!n.ok()) return n.status();
  NcclId id;
  std::memset(&id, 0, sizeof(id));
  const NcclResult r = (*n)->get_unique_id(&id);
  if (r != kNcclSuccess) {
    return absl::UnavailableError(
        absl::StrCat("nccl: ncclGetUniqueId: ", Describe(**n, r, nullptr)));
  }
  return std::string(id.bytes, sizeof(id.bytes));
}

absl::StatusOr<std::unique_ptr<BackendComm>> NcclConnect(int device, const std::string& id,
                                                         uint32_t size, uint32_t rank,
                                                         int64_t timeout_ms) {
  if (absl::Status st = CheckConnect(id, size, rank, timeout_ms); !st.ok()) return st;
  absl::StatusOr<const Nccl*> loaded = Loaded();
  if (!loaded.ok()) return loaded.status();
  const Nccl& n = **loaded;
  // NCCL binds a communicator to the device current on the thread that makes it.
  LOSSD_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
  cudaStream_t stream = nullptr;
  cudaEvent_t ready = nullptr;
  LOSSD_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  if (const cudaError_t e = cudaEventCreateWithFlags(&ready, cudaEventDisableTiming);
      e != cudaSuccess) {
    cudaStreamDestroy(stream);
    return CudaStatus(e, "cudaEventCreateWithFlags");
  }
  auto release = [&] {
    cudaEventDestroy(ready);
    cudaStreamDestroy(stream);
  };
  NcclId nid;
  std::memcpy(nid.bytes, id.data(), sizeof(nid.bytes));
  NcclConfigHead config{offsetof(NcclConfigHead, blocking) + sizeof(int), kNcclConfigMagic,
                        static_cast<unsigned int>(kNcclMinVersion), 0};
  NcclCommHandle comm = nullptr;
  const NcclResult r = n.comm_init_rank_config(&comm, static_cast<int>(size), nid,
                                               static_cast<int>(rank), &config);
  if (r != kNcclSuccess && r != kNcclInProgress) {
    const std::string why = Describe(n, r, comm);
    if (comm != nullptr) n.comm_abort(comm);
    release();
    return absl::UnavailableError(absl::StrCat("nccl: ncclCommInitRankConfig (member ", rank,
                                               " of ", size, "): ", why));
  }
  if (absl::Status st = AwaitInit(n, comm, size, rank, timeout_ms); !st.ok()) {
    release();
    return st;
  }
  return std::unique_ptr<BackendComm>(
      new NcclComm(&n, device, comm, stream, ready, size, rank, timeout_ms));
}

}  // namespace cuda
}  // namespace lossd
