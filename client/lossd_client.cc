#include "client/lossd_client.h"

#include <malloc.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <deque>
#include <functional>
#include <new>
#include <optional>
#include <random>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "client/health_check.h"
#include "core/status_macros.h"
#include "wire/part_codec.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/support/client_callback.h"
#include "lossd/v1/lossd.grpc.pb.h"
#include "lossd/v1/lossd.pb.h"

namespace lossd {
namespace client {

namespace {

constexpr char kComputeMethod[] = "/lossd.v1.Loss/Compute";
constexpr char kPutWeightsMethod[] = "/lossd.v1.Loss/PutWeights";
constexpr char kFetchGradientsMethod[] = "/lossd.v1.Loss/FetchGradients";
// A channel argument that differs between a client's channels, so that gRPC gives each its
// own subchannel (and TCP connection) even in a local subchannel pool.
constexpr char kConnectionIndexArg[] = "lossd.connection_index";
// The default rule stripes over at most this many connections: four gave 3-6x one, more
// adds little on one host.
constexpr int kDefaultMaxStripes = 4;
// The server accepts at most this many stripes per upload.
constexpr int kMaxStripes = 64;
// After a stripe hears ABORTED (the server aborted the whole upload and tells every stripe),
// how long the others may take to report on their own before they are cancelled: the stripe
// that caused the abort is then heard with its own error.
constexpr absl::Duration kAbortedGrace = absl::Seconds(1);

v1::DType ToProto(DType t) {
  switch (t) {
    case DType::kBF16:
      return v1::DTYPE_BF16;
    case DType::kF16:
      return v1::DTYPE_FP16;
    case DType::kF32:
      return v1::DTYPE_FP32;
    case DType::kI32:
      return v1::DTYPE_INT32;
    case DType::kI64:
      return v1::DTYPE_INT64;
  }
  return v1::DTYPE_UNSPECIFIED;
}

absl::StatusOr<DType> FromProto(v1::DType t) {
  switch (t) {
    case v1::DTYPE_BF16:
      return DType::kBF16;
    case v1::DTYPE_FP16:
      return DType::kF16;
    case v1::DTYPE_FP32:
      return DType::kF32;
    case v1::DTYPE_INT32:
      return DType::kI32;
    case v1::DTYPE_INT64:
      return DType::kI64;
    default:
      return absl::InternalError(absl::StrCat("server sent an unknown dtype ", t));
  }
}

v1::Reduction ToProto(Reduction r) {
  switch (r) {
    case Reduction::kMean:
      return v1::REDUCTION_MEAN;
    case Reduction::kSum:
      return v1::REDUCTION_SUM;
    case Reduction::kNone:
      return v1::REDUCTION_NONE;
  }
  return v1::REDUCTION_MEAN;
}

void FillSpec(const HostTensor& t, v1::TensorSpec* spec) {
  spec->set_dtype(ToProto(t.dtype()));
  for (int64_t d : t.shape()) spec->add_shape(d);
}

std::string TensorIdName(int32_t id) {
  if (id >= static_cast<int32_t>(OutputTensor::kLoss) &&
      id <= static_cast<int32_t>(OutputTensor::kDb)) {
    return OutputTensorName(static_cast<OutputTensor>(id));
  }
  return absl::StrCat("tensor#", id);
}

// Drives one streaming call (any of the three streaming kinds: on the wire they are all a
// stream each way) to its end: sends every message in order and half-closes, and hands each
// received message to `on_message`. Writes and reads run at once, so a server that answers
// early (an error after the header) is heard at once.
//
// Received messages are handled on the thread that called Run(), not in gRPC's reactions:
// copying a multi-MiB part into its (often freshly allocated, page-faulting) output buffer is
// long work that would otherwise hold up gRPC's event threads; here it overlaps with gRPC
// reading the next part. Up to kMaxQueued messages wait; beyond that reading pauses, so flow
// control holds the server back.
class StreamCall final : public grpc::ClientBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  using Handler = std::function<absl::Status(const grpc::ByteBuffer&)>;

  // on_sent (nullable): called once, on a gRPC thread, when the last message has been
  // written; it must return quickly.
  StreamCall(std::vector<grpc::ByteBuffer> out, Handler on_message,
             std::function<void()> on_sent = nullptr)
      : out_(std::move(out)), on_message_(std::move(on_message)), on_sent_(std::move(on_sent)) {}

  // Blocks until the call is over. Returns the handler's first error (the call is cancelled
  // then), else the call's status.
  absl::Status Run(grpc::GenericStub* stub, const char* method, grpc::ClientContext* ctx) {
    ctx_ = ctx;
    stub->PrepareBidiStreamingCall(ctx, method, grpc::StubOptions(), this);
    // The hold keeps the call open while this thread may still restart a paused read.
    AddHold();
    reading_ = true;
    StartRead(&in_);
    StartNextWrite();
    StartCall();

    absl::Status handler_status;
    for (;;) {
      grpc::ByteBuffer msg;
      bool restart = false;
      {
        absl::MutexLock lock(&mu_);
        mu_.Await(absl::Condition(this, &StreamCall::HasWork));
        if (queue_.empty()) break;  // the response stream has ended
        msg = std::move(queue_.front());
        queue_.pop_front();
        if (!reading_ && !read_ended_) restart = reading_ = true;
      }
      if (restart) StartRead(&in_);
      handler_status = on_message_(msg);
      if (!handler_status.ok()) {
        absl::MutexLock lock(&mu_);
        stop_reading_ = true;
        queue_.clear();
        break;
      }
    }
    if (!handler_status.ok()) ctx_->TryCancel();
    RemoveHold();
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(&done_));
    // gRPC has released these by now, except for slices the transport still holds (the
    // caller's SliceTracker waits for those).
    out_.clear();
    queue_.clear();
    if (!handler_status.ok()) return handler_status;
    return FromGrpcStatus(status_);
  }

  void OnWriteDone(bool ok) override {
    if (!ok) return;  // the call is broken; OnDone brings the status
    ++next_;
    if (next_ == out_.size() && on_sent_) on_sent_();
    StartNextWrite();
  }

  void OnReadDone(bool ok) override {
    bool restart = false;
    {
      absl::MutexLock lock(&mu_);
      if (!ok) {  // end of the response stream
        reading_ = false;
        read_ended_ = true;
        return;
      }
      queue_.push_back(std::move(in_));
      in_ = grpc::ByteBuffer();
      restart = queue_.size() < kMaxQueued && !stop_reading_;
      reading_ = restart;
    }
    // Only one read is ever outstanding, so in_ is free to reuse.
    if (restart) StartRead(&in_);
  }

  void OnDone(const grpc::Status& status) override {
    absl::MutexLock lock(&mu_);
    status_ = status;
    done_ = true;
  }

 private:
  static constexpr size_t kMaxQueued = 8;

  bool HasWork() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !queue_.empty() || read_ended_; }

  void StartNextWrite() {
    if (next_ + 1 < out_.size()) {
      StartWrite(&out_[next_]);
    } else if (next_ + 1 == out_.size()) {
      StartWriteLast(&out_[next_], grpc::WriteOptions());
    } else if (out_.empty()) {
      StartWritesDone();
    }
  }

  std::vector<grpc::ByteBuffer> out_;
  size_t next_ = 0;      // touched only by StartNextWrite, before StartCall and in OnWriteDone
  grpc::ByteBuffer in_;  // the outstanding read's target
  Handler on_message_;
  std::function<void()> on_sent_;
  grpc::ClientContext* ctx_ = nullptr;

  absl::Mutex mu_;
  std::deque<grpc::ByteBuffer> queue_ ABSL_GUARDED_BY(mu_);
  bool reading_ ABSL_GUARDED_BY(mu_) = false;  // a read is outstanding
  bool read_ended_ ABSL_GUARDED_BY(mu_) = false;
  bool stop_reading_ ABSL_GUARDED_BY(mu_) = false;
  bool done_ ABSL_GUARDED_BY(mu_) = false;
  grpc::Status status_ ABSL_GUARDED_BY(mu_);
};

// Runs the streams of one striped call at once, one thread each, and gathers their statuses.
// Once a stripe has failed the others are pointless, and a stripe the server never heard of
// would leave its siblings waiting there until their deadline, so the group cancels the
// streams still running: at once after any error but ABORTED, and `aborted_grace` after an
// ABORTED (the server aborted the whole upload and is telling every stripe; the grace lets
// the stripe that caused it report why).
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14; older kernels refuse it with EINVAL
#endif

// Faults in the pages of a freshly allocated receive buffer on a helper thread, front to
// back, ahead of the copies into it. MADV_POPULATE_WRITE maps pages without touching their
// contents, so it is safe while received bytes already land. Without it a 2 GiB gradient
// fetch page-faults inside every receive copy (1.4-1.7 GB/s against 2.4-3.0 into touched
// memory, bench/RESULTS.md). Where the kernel lacks it, it does nothing.
class PagePopulator {
 public:
  PagePopulator(void* data, size_t bytes) {
    const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
    const uintptr_t begin = (reinterpret_cast<uintptr_t>(data) + page - 1) / page * page;
    const uintptr_t end = (reinterpret_cast<uintptr_t>(data) + bytes) / page * page;
    if (end <= begin || end - begin < (64u << 20)) return;  // small: not worth a thread
    thread_ = std::thread([this, begin, end] {
      constexpr uintptr_t kStep = 16u << 20;
      for (uintptr_t p = begin; p < end && !stop_.load(std::memory_order_relaxed); p += kStep) {
        if (madvise(reinterpret_cast<void*>(p), std::min(kStep, end - p), MADV_POPULATE_WRITE) !=
            0) {
          return;  // unsupported, or out of memory: the receive faults pages in itself
        }
      }
    });
  }
  ~PagePopulator() {
    stop_.store(true, std::memory_order_relaxed);
    if (thread_.joinable()) thread_.join();
  }
  PagePopulator(const PagePopulator&) = delete;
  PagePopulator& operator=(const PagePopulator&) = delete;

 private:
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

class StripeGroup {
 public:
  StripeGroup(int n, absl::Duration aborted_grace)
      : n_(n), grace_(aborted_grace), contexts_(n, nullptr), statuses_(n), cancelled_(n, false) {}

  // Runs body(i) for every stripe i in [0, n) on a thread of its own and returns when all are
  // over: OK when every stripe succeeded, else the first error (in the order they happened)
  // that is neither ABORTED nor the group's own cancelling, else the first error.
  absl::Status Run(const std::function<absl::Status(int)>& body) {
    std::vector<std::thread> threads;
    threads.reserve(n_);
    for (int i = 0; i < n_; ++i) {
      threads.emplace_back([this, &body, i] { Finish(i, body(i)); });
    }
    {
      absl::MutexLock lock(&mu_);
      while (finished_ < n_) {
        if (absl::Now() >= cancel_at_) CancelAllLocked();
        // Polls, because cancel_at_ can move earlier while this waits.
        mu_.AwaitWithTimeout(absl::Condition(this, &StripeGroup::AllFinished),
                             absl::Milliseconds(20));
      }
    }
    for (std::thread& t : threads) t.join();
    absl::MutexLock lock(&mu_);
    for (int i : failed_) {
      if (!cancelled_[i] && statuses_[i].code() != absl::StatusCode::kAborted) {
        return statuses_[i];
      }
    }
    for (int i : failed_) {
      if (!cancelled_[i]) return statuses_[i];
    }
    return failed_.empty() ? absl::OkStatus() : statuses_[failed_.front()];
  }

  // Stripe i's call is live on `ctx` (until Unregister): the group may cancel it. A stripe
  // that registers after the group gave up is cancelled at once.
  void Register(int i, grpc::ClientContext* ctx) {
    absl::MutexLock lock(&mu_);
    contexts_[i] = ctx;
    if (cancel_all_) {
      ctx->TryCancel();
      cancelled_[i] = true;
    }
  }
  void Unregister(int i) {
    absl::MutexLock lock(&mu_);
    contexts_[i] = nullptr;
  }

 private:
  bool AllFinished() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return finished_ == n_; }

  void Finish(int i, absl::Status status) {
    absl::MutexLock lock(&mu_);
    ++finished_;
    if (status.ok()) return;
    failed_.push_back(i);
    const bool aborted = status.code() == absl::StatusCode::kAborted;
    statuses_[i] = std::move(status);
    cancel_at_ = std::min(cancel_at_, absl::Now() + (aborted ? grace_ : absl::ZeroDuration()));
  }

  void CancelAllLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (cancel_all_) return;
    cancel_all_ = true;
    for (int i = 0; i < n_; ++i) {
      if (contexts_[i] == nullptr) continue;
      contexts_[i]->TryCancel();
      cancelled_[i] = true;
    }
  }

  const int n_;
  const absl::Duration grace_;
  absl::Mutex mu_;
  std::vector<grpc::ClientContext*> contexts_ ABSL_GUARDED_BY(mu_);
  std::vector<absl::Status> statuses_ ABSL_GUARDED_BY(mu_);
  std::vector<bool> cancelled_ ABSL_GUARDED_BY(mu_);  // cancelled by the group
  std::vector<int> failed_ ABSL_GUARDED_BY(mu_);      // stripes that failed, in order
  int finished_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Time cancel_at_ ABSL_GUARDED_BY(mu_) = absl::InfiniteFuture();
  bool cancel_all_ ABSL_GUARDED_BY(mu_) = false;
};

// Runs one streaming call on a ClientContext of its own, destroyed before this returns: the
// context holds the call, and the call keeps any slice it did not send (after an early error)
// until it is destroyed, so a SliceTracker could not finish waiting while it lives. With a
// group, the call is stripe `stripe` of it, which may cancel it.
absl::Status RunStream(grpc::GenericStub* stub, const char* method,
                       const std::function<void(grpc::ClientContext*)>& prepare,
                       std::vector<grpc::ByteBuffer> out, StreamCall::Handler on_message,
                       StripeGroup* group = nullptr, int stripe = 0,
                       std::function<void()> on_sent = nullptr) {
  grpc::ClientContext ctx;
  prepare(&ctx);
  if (group != nullptr) group->Register(stripe, &ctx);
  StreamCall stream(std::move(out), std::move(on_message), std::move(on_sent));
  absl::Status status = stream.Run(stub, method, &ctx);
  if (group != nullptr) group->Unregister(stripe);
  return status;
}

// A random 128-bit upload id, in hex: stripes of one upload share it, and no two uploads
// (from any client) should.
std::string RandomUploadId() {
  std::random_device rd;
  uint64_t half[2];
  for (uint64_t& h : half) h = (static_cast<uint64_t>(rd()) << 32) | rd();
  return absl::StrFormat("%016x%016x", half[0], half[1]);
}

// Appends the parts of one tensor, in byte order: each at most part_bytes rounded down to
// whole elements (at least one), because a server may refuse a part that splits an element.
// The same for the bytes [begin, end) of a tensor (whole elements), offsets into the tensor.
void AppendRange(v1::TensorId id, const HostTensor& t, size_t begin, size_t end,
                 size_t part_bytes, SliceTracker* tracker, std::vector<grpc::ByteBuffer>* out,
                 uint64_t* bytes) {
  const size_t elem = DTypeSize(t.dtype());
  const size_t step = std::max(elem, part_bytes - part_bytes % elem);
  for (size_t off = begin; off < end; off += step) {
    out->push_back(EncodePart(id, off, t.data() + off, std::min(step, end - off), tracker));
  }
  *bytes += end - begin;
}

void AppendParts(v1::TensorId id, const HostTensor& t, size_t part_bytes, SliceTracker* tracker,
                 std::vector<grpc::ByteBuffer>* out, uint64_t* bytes) {
  AppendRange(id, t, 0, t.num_bytes(), part_bytes, tracker, out, bytes);
}

// Owned output buffers of the sizes a request implies, allocated when the call starts and
// written once per page on a helper thread once the inputs are sent, while the server
// computes (the client is idle then; touching pages during the upload would compete with it
// for cores), so the received parts land in memory that is already mapped: a fresh 64 MiB
// buffer takes 16k page faults, which otherwise happen inside the receive copy (about 20 ms
// a call on a 2-core machine). Only for outputs without an output_into buffer, of >= 1 MiB.
class OutputPrefetcher {
 public:
  OutputPrefetcher() = default;
  OutputPrefetcher(const OutputPrefetcher&) = delete;
  OutputPrefetcher& operator=(const OutputPrefetcher&) = delete;
  ~OutputPrefetcher() { Join(); }

  static constexpr size_t kMinBytes = 1 << 20;

  // Allocates an output expected as (dtype, shape); nothing when it is small or memory is
  // short (the receiver then allocates as usual).
  void Add(int32_t id, DType dtype, std::vector<int64_t> shape) {
    absl::StatusOr<size_t> size = TensorByteSize(dtype, shape);
    if (!size.ok() || *size < kMinBytes) return;
    try {
      ready_.push_back({id, HostTensor::Owned(dtype, std::move(shape))});
    } catch (const std::bad_alloc&) {
    }
  }

  // Touches every page of the buffers added so far on a thread of its own, after Sent().
  void Start() {
    if (ready_.empty()) return;
    std::vector<std::pair<uint8_t*, size_t>> spans;
    for (auto& [id, t] : ready_) spans.emplace_back(t.mutable_data(), t.num_bytes());
    toucher_ = std::thread([this, spans] {
      {
        absl::MutexLock lock(&mu_);
        mu_.Await(absl::Condition(&go_));
      }
      for (const auto& [p, n] : spans) {
        for (size_t i = 0; i < n; i += 4096) p[i] = 0;
      }
    });
  }

  // The inputs are sent: touching may begin. Safe from any thread, any number of times.
  void Sent() {
    absl::MutexLock lock(&mu_);
    go_ = true;
  }

  // The buffer prepared for `id` if it has this dtype and shape, else nullopt.
  std::optional<HostTensor> Take(int32_t id, DType dtype, const std::vector<int64_t>& shape) {
    for (auto it = ready_.begin(); it != ready_.end(); ++it) {
      if (it->first != id) continue;
      if (it->second.dtype() != dtype || it->second.shape() != shape) return std::nullopt;
      Join();  // the pages are touched before anyone writes the data
      HostTensor t = std::move(it->second);
      ready_.erase(it);
      return t;
    }
    return std::nullopt;
  }

 private:
  void Join() {
    Sent();  // a call that ends before its inputs are all sent still lets the thread finish
    if (toucher_.joinable()) toucher_.join();
  }

  std::vector<std::pair<int32_t, HostTensor>> ready_;
  std::thread toucher_;
  absl::Mutex mu_;
  bool go_ ABSL_GUARDED_BY(mu_) = false;
};

// One announced output tensor being received.
struct Incoming {
  int32_t id = 0;
  HostTensor tensor;
  size_t size = 0;
  size_t received = 0;
};

// Receives announced tensors part by part, straight into their buffers, checking that each
// tensor's parts come in byte order and add up to exactly its size.
class TensorReceiver {
 public:
  // `into` (nullable): caller memory to receive into. Else a buffer from `prefetched`
  // (nullable) when it holds one of this shape, else a new one.
  absl::Status Announce(int32_t id, DType dtype, std::vector<int64_t> shape,
                        const OutputBuffer* into, OutputPrefetcher* prefetched = nullptr) {
    for (const Incoming& in : incoming_) {
      if (in.id == id) {
        return absl::InternalError(
            absl::StrCat("server announced output ", TensorIdName(id), " twice"));
      }
    }
    Incoming in;
    in.id = id;
    absl::StatusOr<size_t> size = TensorByteSize(dtype, shape);
    if (!size.ok()) {
      return absl::InternalError(absl::StrCat("server announced output ", TensorIdName(id),
                                              " with a bad shape: ", size.status().message()));
    }
    in.size = *size;
    if (into != nullptr && into->data != nullptr) {
      if (into->capacity < in.size) {
        return absl::InvalidArgumentError(
            absl::StrCat("output_into[", TensorIdName(id), "] holds ", into->capacity,
                         " bytes; the ", ShapeString(dtype, shape), " result needs ", in.size));
      }
      in.tensor = HostTensor::MutableView(dtype, std::move(shape), into->data);
    } else if (std::optional<HostTensor> t = prefetched != nullptr
                                                 ? prefetched->Take(id, dtype, shape)
                                                 : std::nullopt) {
      in.tensor = std::move(*t);
    } else {
      try {
        in.tensor = HostTensor::Owned(dtype, std::move(shape));
      } catch (const std::bad_alloc&) {
        return absl::ResourceExhaustedError(
            absl::StrCat("cannot allocate ", in.size, " bytes for output ", TensorIdName(id)));
      }
    }
    incoming_.push_back(std::move(in));
    return absl::OkStatus();
  }

  absl::Status Accept(const StreamFrame& f) {
    Incoming* in = nullptr;
    for (Incoming& i : incoming_) {
      if (i.id == f.tensor()) in = &i;
    }
    if (in == nullptr) {
      return absl::InternalError(absl::StrCat("server sent a part of ", TensorIdName(f.tensor()),
                                              ", which it did not announce"));
    }
    if (f.offset() != in->received) {
      return absl::InternalError(absl::StrCat("parts out of order: ", TensorIdName(in->id),
                                              " part at byte offset ", f.offset(), ", expected ",
                                              in->received));
    }
    if (f.data_size() > in->size - in->received) {
      return absl::DataLossError(absl::StrCat(TensorIdName(in->id), ": part [", f.offset(), ", ",
                                              f.offset() + f.data_size(), ") runs past the ",
                                              in->size, " bytes of ", in->tensor.DebugString()));
    }
    f.CopyDataTo(in->tensor.mutable_data() + in->received);
    in->received += f.data_size();
    bytes_ += f.data_size();
    return absl::OkStatus();
  }

  absl::Status CheckComplete() const {
    for (const Incoming& in : incoming_) {
      if (in.received != in.size) {
        return absl::DataLossError(absl::StrCat("stream ended early: ", TensorIdName(in.id),
                                                " got ", in.received, " of ", in.size, " bytes of ",
                                                in.tensor.DebugString()));
      }
    }
    return absl::OkStatus();
  }

  std::vector<Incoming>& incoming() { return incoming_; }
  uint64_t bytes() const { return bytes_; }

 private:
  std::vector<Incoming> incoming_;
  uint64_t bytes_ = 0;
};

std::vector<int64_t> ShapeOf(const v1::TensorSpec& spec) {
  return std::vector<int64_t>(spec.shape().begin(), spec.shape().end());
}

// Checks a GradientsHeader's specs (fp32 dW (V, H), optional fp32 db (V)); returns their
// byte sizes.
absl::Status CheckGradientsHeader(const v1::GradientsHeader& g, uint64_t* dw_bytes,
                                  uint64_t* db_bytes) {
  const std::vector<int64_t> dw = ShapeOf(g.dw());
  absl::StatusOr<size_t> dw_size = TensorByteSize(DType::kF32, dw);
  if (g.dw().dtype() != v1::DTYPE_FP32 || dw.size() != 2 || !dw_size.ok()) {
    return absl::InternalError(absl::StrCat("server announced dw as dtype ", g.dw().dtype(),
                                            " shape [", absl::StrJoin(dw, ", "),
                                            "], expected fp32 (V, H)"));
  }
  *dw_bytes = *dw_size;
  *db_bytes = 0;
  if (g.has_db()) {
    const std::vector<int64_t> db = ShapeOf(g.db());
    if (g.db().dtype() != v1::DTYPE_FP32 || db != std::vector<int64_t>{dw[0]}) {
      return absl::InternalError(absl::StrCat("server announced db as dtype ", g.db().dtype(),
                                              " shape [", absl::StrJoin(db, ", "),
                                              "], expected fp32 (", dw[0], ")"));
    }
    *db_bytes = static_cast<uint64_t>(dw[0]) * sizeof(float);
  }
  return absl::OkStatus();
}

// Allocates the result's dW (and db) for a header already checked, and copies its counters.
absl::Status AllocateGradients(const v1::GradientsHeader& g, FetchGradientsResult* r) {
  try {
    r->dw = HostTensor::Owned(DType::kF32, ShapeOf(g.dw()));
    if (g.has_db()) r->db = HostTensor::Owned(DType::kF32, ShapeOf(g.db()));
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot allocate the fp32 gradients ", ShapeString(DType::kF32, ShapeOf(g.dw()))));
  }
  r->micro_batches = g.micro_batches();
  r->tokens = g.tokens();
  r->instance = g.instance();
  return absl::OkStatus();
}

// One FetchGradients stream (everything, or a byte range of the concatenation dW | db),
// received straight into place: checks that the parts come in byte order, never leave the
// range or cross from one tensor into the other, and cover the range exactly.
class GradientsStream {
 public:
  // Where dW and db land (null: the bytes are checked and dropped).
  struct Dest {
    uint8_t* dw = nullptr;  // (V, H) fp32
    uint8_t* db = nullptr;  // (V) fp32
  };
  // Called with the (checked) header; says where the bytes go, or fails the stream.
  using HeaderFn = std::function<absl::StatusOr<Dest>(const v1::GradientsHeader&)>;

  // [begin, end): the range asked for; 0, 0 = everything.
  GradientsStream(uint64_t begin, uint64_t end, HeaderFn on_header)
      : begin_(begin), end_(end), on_header_(std::move(on_header)) {}

  absl::Status OnMessage(const grpc::ByteBuffer& msg) {
    absl::Status parsed = frame_.Parse(msg);
    if (!parsed.ok()) return absl::InternalError(parsed.message());
    if (frame_.kind() == StreamFrame::Kind::kHeader) return OnHeader();
    if (frame_.kind() != StreamFrame::Kind::kPart) {
      return absl::InternalError("server sent a message with neither header nor part");
    }
    if (!have_header_) return absl::InternalError("server sent a part before its header");
    const bool is_db = frame_.tensor() == v1::TENSOR_DB;
    if (frame_.tensor() != v1::TENSOR_DW && !(is_db && db_bytes_ > 0)) {
      return absl::InternalError(absl::StrCat("server sent a part of ",
                                              TensorIdName(frame_.tensor()),
                                              ", which it did not announce"));
    }
    const uint64_t limit = is_db ? db_bytes_ : dw_bytes_;
    const uint64_t off = frame_.offset(), size = frame_.data_size();
    if (off > limit || size > limit - off) {
      return absl::DataLossError(absl::StrCat(TensorIdName(frame_.tensor()), ": part [", off,
                                              ", ", off + size, ") runs past its ", limit,
                                              " bytes"));
    }
    const uint64_t at = (is_db ? dw_bytes_ : 0) + off;  // in dW | db
    if (at != next_) {
      return absl::InternalError(absl::StrCat("parts out of order: ", TensorIdName(frame_.tensor()),
                                              " part at byte offset ", off, " (", at,
                                              " in dw|db), expected ", next_));
    }
    if (size > end_ - next_) {
      return absl::DataLossError(absl::StrCat("a part [", at, ", ", at + size,
                                              ") of dw|db runs past the range's end ", end_));
    }
    uint8_t* dst = is_db ? dest_.db : dest_.dw;
    if (dst != nullptr) frame_.CopyDataTo(dst + off);
    next_ += size;
    return absl::OkStatus();
  }

  absl::Status CheckComplete() const {
    if (!have_header_) return absl::InternalError("server ended the stream without a header");
    if (next_ != end_) {
      return absl::DataLossError(absl::StrCat("stream ended early: got dw|db bytes [", begin_,
                                              ", ", next_, ") of [", begin_, ", ", end_, ")"));
    }
    return absl::OkStatus();
  }

  const v1::GradientsHeader& header() const { return header_; }
  bool has_header() const { return have_header_; }
  uint64_t total_bytes() const { return dw_bytes_ + db_bytes_; }

 private:
  absl::Status OnHeader() {
    if (have_header_) return absl::InternalError("server sent a second GradientsHeader");
    have_header_ = true;
    if (!header_.ParseFromString(frame_.header_bytes())) {
      return absl::InternalError("cannot parse the server's GradientsHeader");
    }
    LOSSD_RETURN_IF_ERROR(CheckGradientsHeader(header_, &dw_bytes_, &db_bytes_));
    if (begin_ == 0 && end_ == 0) end_ = total_bytes();
    if (end_ > total_bytes()) {
      return absl::InternalError(absl::StrCat("server answered the range [", begin_, ", ", end_,
                                              ") of an accumulator of ", total_bytes(),
                                              " bytes"));
    }
    next_ = begin_;
    absl::StatusOr<Dest> dest = on_header_(header_);
    if (!dest.ok()) return dest.status();
    dest_ = *dest;
    return absl::OkStatus();
  }

  uint64_t begin_, end_;
  HeaderFn on_header_;
  StreamFrame frame_;
  bool have_header_ = false;
  v1::GradientsHeader header_;
  uint64_t dw_bytes_ = 0, db_bytes_ = 0;
  uint64_t next_ = 0;  // the next expected byte of dW | db
  Dest dest_;
};

// ABORTED unless a range's header says what the first look said: a Compute that added to the
// accumulator in between would make the ranges disagree.
absl::Status CheckSameGradients(const std::string& name, const v1::GradientsHeader& first,
                                const v1::GradientsHeader& g) {
  const bool same = g.dw().SerializeAsString() == first.dw().SerializeAsString() &&
                    g.has_db() == first.has_db() &&
                    g.db().SerializeAsString() == first.db().SerializeAsString() &&
                    g.micro_batches() == first.micro_batches() && g.tokens() == first.tokens() &&
                    g.instance() == first.instance();
  if (same) return absl::OkStatus();
  return absl::AbortedError(absl::StrCat(
      "accumulator '", name, "' changed while its ranges were fetched (micro_batches ",
      first.micro_batches(), " then ", g.micro_batches(), ", tokens ", first.tokens(), " then ",
      g.tokens(), "): a Compute added to it in between; fetch again"));
}

// What Compute expects of each output, from the request.
// The dtype and shape of output `t` of request `r`, with V = `v`.
std::pair<DType, std::vector<int64_t>> OutputSpecOf(const ComputeRequest& r, OutputTensor t,
                                                    int64_t v) {
  const int64_t bt = r.x.dim(0);
  const int64_t h = r.x.dim(1);
  const DType grad = r.grad_dtype.value_or(r.x.dtype());
  switch (t) {
    case OutputTensor::kLoss:
    case OutputTensor::kLse:
    case OutputTensor::kZLoss:
      break;
    case OutputTensor::kPredictions:
      return {DType::kI64, {bt}};
    case OutputTensor::kDx:
      return {grad, {bt, h}};
    case OutputTensor::kDw:
      return {grad, {v, h}};
    case OutputTensor::kDb:
      return {grad, {v}};
  }
  return {DType::kF32, {bt}};
}

absl::Status CheckOutputSpec(const ComputeRequest& r, OutputTensor t, DType dtype,
                             const std::vector<int64_t>& shape) {
  // V is known only for inline weights; with a handle any V >= 1 is accepted.
  const int64_t v = r.w.has_value() ? r.w->dim(0) : (shape.empty() ? -1 : shape[0]);
  const auto [want_dtype, want_shape] = OutputSpecOf(r, t, v);
  if (dtype != want_dtype || shape != want_shape || (!shape.empty() && shape[0] < 0)) {
    return absl::InternalError(absl::StrCat("server announced ", OutputTensorName(t), " as ",
                                            ShapeString(dtype, shape), ", expected ",
                                            ShapeString(want_dtype, want_shape)));
  }
  return absl::OkStatus();
}

// Caller buffers for outputs the call does not return, or too small for what it returns, are
// refused before anything is sent: refused only once the server has answered, the micro-batch
// would already be in a named accumulator, and a retry would add it twice.
absl::Status ValidateOutputInto(const ComputeRequest& r) {
  const bool none = r.options.reduction == Reduction::kNone;
  const int64_t v = r.w.has_value() ? r.w->dim(0) : -1;  // -1: behind a weight handle
  for (const auto& [tensor, buf] : r.output_into) {
    bool returned = true;
    switch (tensor) {
      case OutputTensor::kLoss: returned = none; break;
      case OutputTensor::kZLoss: returned = none && r.want.z_loss; break;
      case OutputTensor::kLse: returned = r.want.lse; break;
      case OutputTensor::kPredictions: returned = r.want.predictions; break;
      case OutputTensor::kDx: returned = r.want.dx; break;
      case OutputTensor::kDw: returned = r.want.dw && r.accumulator.empty(); break;
      case OutputTensor::kDb:
        // With a handle the bias is the handle's: whether one comes back is known only then.
        returned = r.want.db && r.accumulator.empty() && (r.bias.has_value() || !r.w.has_value());
        break;
    }
    const std::string name = OutputTensorName(tensor);
    if (!returned) {
      return absl::InvalidArgumentError(absl::StrCat(
          "output_into[", name, "]: this call does not return ", name,
          " (see want, options.reduction and accumulator)"));
    }
    if (v < 0 && (tensor == OutputTensor::kDw || tensor == OutputTensor::kDb)) continue;
    const auto [dtype, shape] = OutputSpecOf(r, tensor, v);
    absl::StatusOr<size_t> need = TensorByteSize(dtype, shape);
    if (need.ok() && buf.data != nullptr && buf.capacity < *need) {
      return absl::InvalidArgumentError(
          absl::StrCat("output_into[", name, "] holds ", buf.capacity, " bytes; the ",
                       ShapeString(dtype, shape), " result needs ", *need));
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateRequest(const ComputeRequest& r) {
  LOSSD_RETURN_IF_ERROR(r.x.Validate("x"));
  LOSSD_RETURN_IF_ERROR(r.targets.Validate("targets"));
  if (r.x.rank() != 2) {
    return absl::InvalidArgumentError(absl::StrCat("x must be (BT, H), got ", r.x.DebugString()));
  }
  if (r.w.has_value() == !r.weight_handle.empty()) {
    return absl::InvalidArgumentError("give exactly one of w and weight_handle");
  }
  if (r.w.has_value()) {
    LOSSD_RETURN_IF_ERROR(r.w->Validate("w"));
    if (r.w->rank() != 2) {
      return absl::InvalidArgumentError(
          absl::StrCat("w must be (V, H), got ", r.w->DebugString()));
    }
  }
  if (r.bias.has_value()) {
    if (!r.w.has_value()) {
      return absl::InvalidArgumentError(
          "bias goes with inline weights; a weight handle carries its own bias");
    }
    LOSSD_RETURN_IF_ERROR(r.bias->Validate("bias"));
  }
  if (r.class_weights.has_value()) {
    LOSSD_RETURN_IF_ERROR(r.class_weights->Validate("class_weights"));
  }
  if (r.grad_output.has_value()) {
    LOSSD_RETURN_IF_ERROR(r.grad_output->Validate("grad_output"));
  }
  return ValidateOutputInto(r);
}

}  // namespace

const char* OutputTensorName(OutputTensor t) {
  switch (t) {
    case OutputTensor::kLoss:
      return "loss";
    case OutputTensor::kLse:
      return "lse";
    case OutputTensor::kZLoss:
      return "z_loss";
    case OutputTensor::kPredictions:
      return "predictions";
    case OutputTensor::kDx:
      return "dx";
    case OutputTensor::kDw:
      return "dw";
    case OutputTensor::kDb:
      return "db";
  }
  return "unknown";
}

const HostTensor* ComputeResult::Find(OutputTensor t) const {
  auto it = outputs.find(t);
  return it == outputs.end() ? nullptr : &it->second;
}

absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
}

struct LossClient::Connection {
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<grpc::GenericStub> generic;
  std::unique_ptr<v1::Loss::Stub> stub;
};

absl::StatusOr<std::unique_ptr<LossClient>> LossClient::Create(const ClientOptions& options) {
  if (options.target.empty()) return absl::InvalidArgumentError("empty target");
  if (options.part_bytes == 0) return absl::InvalidArgumentError("part_bytes must be > 0");
  // A part's message adds a few dozen bytes of framing to its data.
  if (options.max_send_message_bytes >= 0 &&
      options.part_bytes + 64 > static_cast<size_t>(options.max_send_message_bytes)) {
    return absl::InvalidArgumentError(absl::StrCat("part_bytes ", options.part_bytes,
                                                   " does not fit max_send_message_bytes ",
                                                   options.max_send_message_bytes));
  }
  if (options.tls_client_cert.empty() != options.tls_client_key.empty()) {
    return absl::InvalidArgumentError("tls_client_cert and tls_client_key go together");
  }
  if (!options.tls && (!options.tls_root_certs.empty() || !options.tls_client_cert.empty() ||
                       !options.tls_server_name.empty())) {
    return absl::InvalidArgumentError("TLS settings given without tls = true");
  }
  if (options.connections < 1 || options.connections > 256) {
    return absl::InvalidArgumentError(
        absl::StrCat("connections must be in [1, 256], got ", options.connections));
  }
  if (options.stripes < 0 || options.stripes > kMaxStripes) {
    return absl::InvalidArgumentError(absl::StrCat("stripes must be in [0, ", kMaxStripes,
                                                   "] (0 = the default rule), got ",
                                                   options.stripes));
  }
  if (options.stripes > options.connections) {
    return absl::InvalidArgumentError(
        absl::StrCat("stripes (", options.stripes, ") needs as many connections, got ",
                     options.connections, ": each stripe is a stream on a connection of its own"));
  }
  return std::unique_ptr<LossClient>(new LossClient(options));
}

LossClient::LossClient(const ClientOptions& options) : options_(options) {
  for (int i = 0; i < options_.connections; ++i) {
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(options_.max_receive_message_bytes);
    args.SetMaxSendMessageSize(options_.max_send_message_bytes);
    // Channels with equal arguments share one connection through gRPC's global subchannel
    // pool; a local pool plus a distinct argument gives each channel its own.
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    args.SetInt(kConnectionIndexArg, i);
    std::shared_ptr<grpc::ChannelCredentials> creds = grpc::InsecureChannelCredentials();
    if (options_.tls) {
      grpc::SslCredentialsOptions ssl;
      ssl.pem_root_certs = options_.tls_root_certs;
      ssl.pem_cert_chain = options_.tls_client_cert;
      ssl.pem_private_key = options_.tls_client_key;
      creds = grpc::SslCredentials(ssl);
      if (!options_.tls_server_name.empty()) {
        args.SetSslTargetNameOverride(options_.tls_server_name);
      }
    }
    auto c = std::make_unique<Connection>();
    c->channel = grpc::CreateCustomChannel(options_.target, creds, args);
    c->generic = std::make_unique<grpc::GenericStub>(c->channel);
    c->stub = v1::Loss::NewStub(c->channel);
    connections_.push_back(std::move(c));
  }
}

LossClient::~LossClient() = default;

LossClient::Connection& LossClient::NextConnection() {
  return *connections_[next_.fetch_add(1, std::memory_order_relaxed) % connections_.size()];
}

std::vector<LossClient::Connection*> LossClient::NextConnections(int n) {
  const uint64_t first = next_.fetch_add(n, std::memory_order_relaxed);
  std::vector<Connection*> out;
  for (int i = 0; i < n; ++i) out.push_back(connections_[(first + i) % connections_.size()].get());
  return out;
}

int LossClient::StripesFor(uint64_t bytes) const {
  if (options_.stripes > 0) return options_.stripes;
  if (bytes < options_.auto_stripe_bytes) return 1;
  return std::min(options_.connections, kDefaultMaxStripes);
}

void LossClient::PrepareContext(const CallOptions& call, grpc::ClientContext* ctx) const {
  const absl::Duration deadline = call.deadline.value_or(options_.deadline);
  if (deadline != absl::InfiniteDuration()) {
    ctx->set_deadline(std::chrono::system_clock::now() + absl::ToChronoNanoseconds(deadline));
  }
  ctx->set_wait_for_ready(options_.wait_for_ready);
  if (!options_.auth_token.empty()) {
    ctx->AddMetadata("authorization", "Bearer " + options_.auth_token);
  }
  for (const auto& kv : options_.metadata) ctx->AddMetadata(kv.first, kv.second);
}

absl::StatusOr<ComputeResult> LossClient::Compute(const ComputeRequest& r,
                                                  const CallOptions& call) {
  LOSSD_RETURN_IF_ERROR(ValidateRequest(r));
  const absl::Time start = absl::Now();

  v1::ComputeRequest head;
  v1::ComputeHeader* h = head.mutable_header();
  FillSpec(r.x, h->mutable_x());
  if (r.w.has_value()) FillSpec(*r.w, h->mutable_w());
  h->set_weight_handle(r.weight_handle);
  if (r.bias.has_value()) FillSpec(*r.bias, h->mutable_bias());
  FillSpec(r.targets, h->mutable_targets());
  if (r.class_weights.has_value()) FillSpec(*r.class_weights, h->mutable_class_weights());
  if (r.grad_output.has_value()) FillSpec(*r.grad_output, h->mutable_grad_output());
  v1::LossOptions* o = h->mutable_options();
  o->set_ignore_index(r.options.ignore_index);
  o->set_reduction(ToProto(r.options.reduction));
  o->set_label_smoothing(r.options.label_smoothing);
  o->set_lse_square_scale(r.options.z_loss_scale);
  o->set_softcap(r.options.softcap);
  o->set_grad_dtype(r.grad_dtype.has_value() ? ToProto(*r.grad_dtype) : v1::DTYPE_UNSPECIFIED);
  o->set_grad_scale(r.options.grad_scale);
  o->set_chunk_rows(r.options.chunk_rows);
  o->set_token_scaling(r.options.token_scaling);  // false is not on the wire: old servers too
  v1::Outputs* want = h->mutable_outputs();
  want->set_dx(r.want.dx);
  want->set_dw(r.want.dw);
  want->set_db(r.want.db);
  want->set_lse(r.want.lse);
  want->set_z_loss(r.want.z_loss);
  want->set_accuracy(r.want.accuracy);
  want->set_predictions(r.want.predictions);
  h->set_accumulator(r.accumulator);
  if (!r.accumulator.empty()) h->set_accumulator_instance(AccumulatorInstance(r.accumulator));
  h->set_response_part_bytes(options_.response_part_bytes);
  const bool overlap = r.overlap.value_or(options_.overlap);
  h->set_overlap(overlap);

  // The tracker outlives the call: it waits (in its destructor too) until gRPC lets go of
  // the caller's memory.
  SliceTracker tracker;
  ComputeResult result;
  std::vector<grpc::ByteBuffer> out;
  out.push_back(EncodeMessage(head));
  // Small tensors and the weight first, X last: a server can start on the first rows of X
  // while the rest is still arriving, but needs everything else for that.
  const size_t pb = options_.part_bytes;
  if (r.w.has_value()) AppendParts(v1::TENSOR_W, *r.w, pb, &tracker, &out, &result.bytes_sent);
  if (r.bias.has_value()) {
    AppendParts(v1::TENSOR_BIAS, *r.bias, pb, &tracker, &out, &result.bytes_sent);
  }
  if (r.class_weights.has_value()) {
    AppendParts(v1::TENSOR_CLASS_WEIGHTS, *r.class_weights, pb, &tracker, &out, &result.bytes_sent);
  }
  AppendParts(v1::TENSOR_TARGETS, r.targets, pb, &tracker, &out, &result.bytes_sent);
  if (r.grad_output.has_value()) {
    AppendParts(v1::TENSOR_GRAD_OUTPUT, *r.grad_output, pb, &tracker, &out, &result.bytes_sent);
  }
  AppendParts(v1::TENSOR_X, r.x, pb, &tracker, &out, &result.bytes_sent);

  // dX (and dW with inline weights) have known shapes: their buffers get ready meanwhile.
  OutputPrefetcher prefetched;
  const int32_t dx_id = static_cast<int32_t>(OutputTensor::kDx);
  const int32_t dw_id = static_cast<int32_t>(OutputTensor::kDw);
  const DType grad = r.grad_dtype.value_or(r.x.dtype());
  if (r.want.dx && r.output_into.count(OutputTensor::kDx) == 0) {
    prefetched.Add(dx_id, grad, {r.x.dim(0), r.x.dim(1)});
  }
  if (r.want.dw && r.accumulator.empty() && r.w.has_value() &&
      r.output_into.count(OutputTensor::kDw) == 0) {
    prefetched.Add(dw_id, grad, {r.w->dim(0), r.w->dim(1)});
  }
  prefetched.Start();

  // Without overlap: the summary, then the parts. With overlap: a preliminary summary that
  // announces the outputs, the parts, then the final summary (the same outputs) last.
  bool have_summary = false;    // the outputs are announced
  bool have_results = false;    // the final summary arrived
  int announced = 0;
  TensorReceiver receiver;
  StreamFrame frame;
  auto on_message = [&](const grpc::ByteBuffer& msg) -> absl::Status {
    absl::Status parsed = frame.Parse(msg);
    if (!parsed.ok()) return absl::InternalError(parsed.message());
    if (frame.kind() == StreamFrame::Kind::kPart) {
      if (!have_summary) return absl::InternalError("server sent a part before its summary");
      if (have_results && overlap) {
        return absl::InternalError("server sent a part after its final summary");
      }
      return receiver.Accept(frame);
    }
    if (frame.kind() != StreamFrame::Kind::kHeader) {
      return absl::InternalError("server sent a ComputeResponse with neither summary nor part");
    }
    if (have_results) return absl::InternalError("server sent a second summary");
    v1::ComputeSummary s;
    if (!s.ParseFromString(frame.header_bytes())) {
      return absl::InternalError("cannot parse the server's ComputeSummary");
    }
    if (s.tensors_size() != s.specs_size()) {
      return absl::InternalError(absl::StrCat("summary lists ", s.tensors_size(), " tensors but ",
                                              s.specs_size(), " specs"));
    }
    if (s.preliminary() != (overlap && !have_summary)) {
      return absl::InternalError(absl::StrCat(
          "server sent a ", s.preliminary() ? "preliminary" : "final", " summary where a ",
          s.preliminary() ? "final" : "preliminary", " one was due (overlap ",
          overlap ? "on" : "off", ")"));
    }
    if (have_summary) {  // the final summary of an overlapped call: the same outputs
      if (s.tensors_size() != announced) {
        return absl::InternalError(absl::StrCat("final summary lists ", s.tensors_size(),
                                                " tensors; the preliminary one ", announced));
      }
      LOSSD_RETURN_IF_ERROR(receiver.CheckComplete());
    }
    have_results = !s.preliminary();
    result.loss = s.loss();
    result.z_loss = s.z_loss();
    result.accuracy = s.accuracy();
    result.tokens = s.tokens();
    result.compute_seconds = s.compute_seconds();
    result.backend = s.backend();
    result.instance = s.instance();
    result.accumulated_micro_batches = s.accumulated_micro_batches();
    result.nonfinite.clear();
    for (int t : s.nonfinite()) result.nonfinite.push_back(static_cast<OutputTensor>(t));
    if (have_summary) return absl::OkStatus();
    have_summary = true;
    announced = s.tensors_size();
    for (int i = 0; i < s.tensors_size(); ++i) {
      const int32_t id = s.tensors(i);
      if (id < static_cast<int32_t>(OutputTensor::kLoss) ||
          id > static_cast<int32_t>(OutputTensor::kDb)) {
        return absl::InternalError(
            absl::StrCat("summary lists ", TensorIdName(id), ", not an output tensor"));
      }
      const OutputTensor t = static_cast<OutputTensor>(id);
      absl::StatusOr<DType> dtype = FromProto(s.specs(i).dtype());
      if (!dtype.ok()) return dtype.status();
      std::vector<int64_t> shape = ShapeOf(s.specs(i));
      LOSSD_RETURN_IF_ERROR(CheckOutputSpec(r, t, *dtype, shape));
      auto into = r.output_into.find(t);
      LOSSD_RETURN_IF_ERROR(
          receiver.Announce(id, *dtype, std::move(shape),
                            into == r.output_into.end() ? nullptr : &into->second, &prefetched));
    }
    return absl::OkStatus();
  };

  const absl::Status status = RunStream(
      NextConnection().generic.get(), kComputeMethod,
      [&](grpc::ClientContext* ctx) { PrepareContext(call, ctx); }, std::move(out), on_message,
      /*group=*/nullptr, /*stripe=*/0, [&prefetched] { prefetched.Sent(); });
  tracker.WaitUntilReleased();
  LOSSD_RETURN_IF_ERROR(status);
  if (!have_results) {
    return absl::InternalError(have_summary ? "server ended the stream without its final summary"
                                            : "server ended the stream without a summary");
  }
  LOSSD_RETURN_IF_ERROR(receiver.CheckComplete());
  for (Incoming& in : receiver.incoming()) {
    result.outputs.emplace(static_cast<OutputTensor>(in.id), std::move(in.tensor));
  }
  result.bytes_received = receiver.bytes();
  result.wall_seconds = absl::ToDoubleSeconds(absl::Now() - start);
  if (!r.accumulator.empty() && !result.instance.empty()) {
    // The sum's home from its first Compute on: later calls ask for the same instance. Calls
    // that started before it was known (the first micro-batches of a new accumulator, sent
    // at once from several threads) were not pinned, and are checked here instead.
    absl::MutexLock lock(&instances_mu_);
    auto it = accumulator_instances_.find(r.accumulator);
    if (it != accumulator_instances_.end()) {
      if (it->second.first != result.instance) {
        return absl::FailedPreconditionError(absl::StrCat(
            "accumulator '", r.accumulator, "' began on server instance '", it->second.first,
            "', but this Compute was added to one on instance '", result.instance,
            "' (concurrent first Computes reached different replicas): the sum is split; "
            "drop the accumulator and redo the step on one replica"));
      }
      it->second.second = instances_seen_++;  // recently used: evicted last
    } else {
      if (accumulator_instances_.size() >= kRememberedAccumulators) {
        auto oldest = accumulator_instances_.begin();
        for (auto o = oldest; o != accumulator_instances_.end(); ++o) {
          if (o->second.second < oldest->second.second) oldest = o;
        }
        accumulator_instances_.erase(oldest);
      }
      accumulator_instances_.emplace(r.accumulator,
                                     std::make_pair(result.instance, instances_seen_++));
    }
  }
  return result;
}

std::string LossClient::AccumulatorInstance(const std::string& accumulator) const {
  absl::MutexLock lock(&instances_mu_);
  auto it = accumulator_instances_.find(accumulator);
  return it == accumulator_instances_.end() ? std::string() : it->second.first;
}

namespace {

// Runs one PutWeights stream and takes its single reply.
absl::Status RunPutWeightsStream(grpc::GenericStub* stub,
                                 const std::function<void(grpc::ClientContext*)>& prepare,
                                 std::vector<grpc::ByteBuffer> out, v1::PutWeightsResponse* reply,
                                 StripeGroup* group = nullptr, int stripe = 0) {
  int replies = 0;
  auto on_message = [&](const grpc::ByteBuffer& msg) -> absl::Status {
    if (++replies > 1) return absl::InternalError("server sent more than one PutWeights reply");
    absl::Status s = DecodeMessage(msg, reply);
    return s.ok() ? s : absl::InternalError(s.message());
  };
  LOSSD_RETURN_IF_ERROR(
      RunStream(stub, kPutWeightsMethod, prepare, std::move(out), on_message, group, stripe));
  if (replies != 1) return absl::InternalError("server ended PutWeights without a reply");
  if (reply->handle().empty()) return absl::InternalError("server returned an empty handle");
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<PutWeightsResult> LossClient::PutWeights(const HostTensor& w, const HostTensor* bias,
                                                        const CallOptions& call) {
  LOSSD_RETURN_IF_ERROR(w.Validate("w"));
  if (bias != nullptr) LOSSD_RETURN_IF_ERROR(bias->Validate("bias"));
  // Every stripe needs at least one element of W.
  const int stripes = static_cast<int>(std::min<int64_t>(
      StripesFor(w.num_bytes() + (bias != nullptr ? bias->num_bytes() : 0)), w.num_elements()));
  if (stripes > 1) return PutWeightsStriped(w, bias, stripes, call);

  v1::PutWeightsRequest head;
  FillSpec(w, head.mutable_header()->mutable_w());
  if (bias != nullptr) FillSpec(*bias, head.mutable_header()->mutable_bias());
  SliceTracker tracker;
  uint64_t sent = 0;
  std::vector<grpc::ByteBuffer> out;
  out.push_back(EncodeMessage(head));
  AppendParts(v1::TENSOR_W, w, options_.part_bytes, &tracker, &out, &sent);
  if (bias != nullptr) {
    AppendParts(v1::TENSOR_BIAS, *bias, options_.part_bytes, &tracker, &out, &sent);
  }
  v1::PutWeightsResponse reply;
  const absl::Status status = RunPutWeightsStream(
      NextConnection().generic.get(), [&](grpc::ClientContext* ctx) { PrepareContext(call, ctx); },
      std::move(out), &reply);
  tracker.WaitUntilReleased();
  LOSSD_RETURN_IF_ERROR(status);
  return PutWeightsResult{reply.handle(), reply.bytes(), 1};
}

absl::StatusOr<PutWeightsResult> LossClient::PutWeightsStriped(const HostTensor& w,
                                                               const HostTensor* bias, int stripes,
                                                               const CallOptions& call) {
  const std::string upload_id = RandomUploadId();
  const uint64_t elem = DTypeSize(w.dtype());
  const uint64_t elems = static_cast<uint64_t>(w.num_elements());
  std::vector<Connection*> conns = NextConnections(stripes);
  std::vector<v1::PutWeightsResponse> replies(stripes);
  StripeGroup group(stripes, kAbortedGrace);
  const absl::Status status = group.Run([&](int i) -> absl::Status {
    // Equal shares of whole elements; the bias rides with the first.
    const uint64_t begin = elem * (elems * i / stripes);
    const uint64_t end = elem * (elems * (i + 1) / stripes);
    v1::PutWeightsRequest head;
    v1::WeightsHeader* h = head.mutable_header();
    FillSpec(w, h->mutable_w());
    if (bias != nullptr) FillSpec(*bias, h->mutable_bias());
    h->set_upload_id(upload_id);
    h->set_stripes(static_cast<uint32_t>(stripes));
    h->set_w_begin(begin);
    h->set_w_end(end);
    SliceTracker tracker;
    uint64_t sent = 0;
    std::vector<grpc::ByteBuffer> out;
    out.push_back(EncodeMessage(head));
    AppendRange(v1::TENSOR_W, w, begin, end, options_.part_bytes, &tracker, &out, &sent);
    if (i == 0 && bias != nullptr) {
      AppendParts(v1::TENSOR_BIAS, *bias, options_.part_bytes, &tracker, &out, &sent);
    }
    const absl::Status s = RunPutWeightsStream(
        conns[i]->generic.get(), [&](grpc::ClientContext* ctx) { PrepareContext(call, ctx); },
        std::move(out), &replies[i], &group, i);
    tracker.WaitUntilReleased();
    return s;
  });
  LOSSD_RETURN_IF_ERROR(status);
  for (int i = 1; i < stripes; ++i) {
    if (replies[i].handle() != replies[0].handle()) {
      return absl::InternalError(absl::StrCat("stripes of upload '", upload_id,
                                              "' got different handles: '", replies[0].handle(),
                                              "' and '", replies[i].handle(), "'"));
    }
  }
  return PutWeightsResult{replies[0].handle(), replies[0].bytes(), stripes};
}

absl::Status LossClient::DropWeights(const std::string& handle, const CallOptions& call) {
  v1::DropWeightsRequest req;
  req.set_handle(handle);
  v1::DropWeightsResponse resp;
  grpc::ClientContext ctx;
  PrepareContext(call, &ctx);
  return FromGrpcStatus(NextConnection().stub->DropWeights(&ctx, req, &resp));
}

uint64_t FetchRangesWithin(uint64_t total_bytes, uint64_t budget_bytes, uint64_t at_least) {
  const uint64_t values = total_bytes / sizeof(float);
  at_least = std::max<uint64_t>(at_least, 1);
  if ((values + at_least - 1) / at_least * sizeof(float) <= budget_bytes) return 0;
  const uint64_t per_range = budget_bytes / 2 / sizeof(float);
  if (per_range == 0) return 0;
  const uint64_t ranges = std::max(at_least, (values + per_range - 1) / per_range);
  return ranges > kMaxFetchRanges ? 0 : ranges;
}

absl::StatusOr<FetchGradientsResult> LossClient::FetchGradients(const std::string& accumulator,
                                                                bool reset,
                                                                const CallOptions& call) {
  auto prepare = [&](grpc::ClientContext* ctx) { PrepareContext(call, ctx); };
  const std::string instance = AccumulatorInstance(accumulator);
  auto request = [&](bool reset_it, uint64_t begin, uint64_t end) {
    v1::FetchGradientsRequest req;
    req.set_accumulator(accumulator);
    req.set_accumulator_instance(instance);
    req.set_reset(reset_it);
    req.set_response_part_bytes(options_.response_part_bytes);
    req.set_range_begin(begin);
    req.set_range_end(end);
    std::vector<grpc::ByteBuffer> out;
    out.push_back(EncodeMessage(req));
    return out;
  };

  // Striping needs the accumulator's size: a one-element range fetch says it.
  std::optional<GradientsStream> look;
  auto take_look = [&]() -> absl::Status {
    look.emplace(0, sizeof(float), [](const v1::GradientsHeader&) {
      return GradientsStream::Dest{};
    });
    LOSSD_RETURN_IF_ERROR(RunStream(
        NextConnection().generic.get(), kFetchGradientsMethod, prepare, request(false, 0, 4),
        [&](const grpc::ByteBuffer& msg) { return look->OnMessage(msg); }));
    return look->CheckComplete();
  };
  const bool may_stripe =
      options_.stripes > 1 || (options_.stripes == 0 && options_.connections > 1);
  int stripes = 1;
  if (may_stripe) {
    LOSSD_RETURN_IF_ERROR(take_look());
    stripes = static_cast<int>(
        std::min<uint64_t>(StripesFor(look->total_bytes()), look->total_bytes() / sizeof(float)));
  }

  FetchGradientsResult result;
  std::optional<PagePopulator> populate;  // joined before the result is returned
  absl::Status refused;  // what the server said to a fetch too large for its memory budget
  if (stripes <= 1) {
    GradientsStream whole(0, 0, [&](const v1::GradientsHeader& g)
                                    -> absl::StatusOr<GradientsStream::Dest> {
      LOSSD_RETURN_IF_ERROR(AllocateGradients(g, &result));
      populate.emplace(result.dw.mutable_data(), result.dw.num_bytes());
      return GradientsStream::Dest{result.dw.mutable_data(),
                                   result.db.has_value() ? result.db->mutable_data() : nullptr};
    });
    absl::Status s = RunStream(
        NextConnection().generic.get(), kFetchGradientsMethod, prepare, request(reset, 0, 0),
        [&](const grpc::ByteBuffer& msg) { return whole.OnMessage(msg); });
    if (s.ok()) s = whole.CheckComplete();
    populate.reset();
    if (s.ok()) return result;
    // Refused before its header (so nothing was reset) for want of memory: it may be larger
    // than the server's whole memory budget, which ranges can fit (below).
    if (s.code() != absl::StatusCode::kResourceExhausted || whole.has_header()) return s;
    refused = s;
    if (!look.has_value()) LOSSD_RETURN_IF_ERROR(take_look());
  }

  // Ranges of whole fp32 values straight into the result: `stripes` streams at once, one per
  // connection, each fetching its share of the ranges one after another.
  const uint64_t values = look->total_bytes() / sizeof(float);
  LOSSD_RETURN_IF_ERROR(AllocateGradients(look->header(), &result));
  const GradientsStream::Dest dest{result.dw.mutable_data(),
                                   result.db.has_value() ? result.db->mutable_data() : nullptr};
  auto fetch_ranges = [&](int streams, uint64_t ranges) -> absl::Status {
    std::vector<Connection*> conns = NextConnections(streams);
    StripeGroup group(streams, absl::ZeroDuration());
    return group.Run([&](int i) -> absl::Status {
      for (uint64_t j = i; j < ranges; j += streams) {
        const uint64_t begin = sizeof(float) * (values * j / ranges);
        const uint64_t end = sizeof(float) * (values * (j + 1) / ranges);
        GradientsStream range(begin, end, [&](const v1::GradientsHeader& g)
                                              -> absl::StatusOr<GradientsStream::Dest> {
          LOSSD_RETURN_IF_ERROR(CheckSameGradients(accumulator, look->header(), g));
          return dest;
        });
        LOSSD_RETURN_IF_ERROR(RunStream(
            conns[i]->generic.get(), kFetchGradientsMethod, prepare, request(false, begin, end),
            [&](const grpc::ByteBuffer& msg) { return range.OnMessage(msg); }, &group, i));
        LOSSD_RETURN_IF_ERROR(range.CheckComplete());
      }
      return absl::OkStatus();
    });
  };
  // Ranges small enough for the server's memory budget, after a fetch was refused for want
  // of memory: as many as it takes (at least `stripes`), or the refusal where ranges cannot
  // help.
  auto ranges_within_budget = [&]() -> absl::StatusOr<uint64_t> {
    absl::StatusOr<ServerInfoResult> info = ServerInfo(call);
    if (!info.ok()) return refused;
    const uint64_t ranges = FetchRangesWithin(look->total_bytes(), info->memory_budget_bytes,
                                              static_cast<uint64_t>(stripes));
    if (ranges == 0) return refused;
    return ranges;
  };

  populate.emplace(result.dw.mutable_data(), result.dw.num_bytes());
  uint64_t ranges = static_cast<uint64_t>(stripes);
  absl::Status s;
  if (!refused.ok()) {
    absl::StatusOr<uint64_t> p = ranges_within_budget();
    s = p.status();
    if (p.ok()) ranges = *p;
  }
  if (s.ok()) s = fetch_ranges(stripes, ranges);
  if (s.code() == absl::StatusCode::kResourceExhausted && refused.ok()) {
    // Striped ranges can each be larger than the budget too. Ranges change nothing on the
    // server, so fetching them again is safe.
    refused = s;
    absl::StatusOr<uint64_t> p = ranges_within_budget();
    s = p.status();
    if (p.ok()) {
      ranges = *p;
      s = fetch_ranges(stripes, ranges);
    }
  }
  populate.reset();
  LOSSD_RETURN_IF_ERROR(s);
  // A ranged fetch cannot reset: drop it instead, now that every range is here.
  if (reset) LOSSD_RETURN_IF_ERROR(DropAccumulator(accumulator, call));
  result.stripes = stripes;
  result.ranges = static_cast<int>(ranges);
  return result;
}

absl::Status LossClient::DropAccumulator(const std::string& accumulator, const CallOptions& call) {
  {
    absl::MutexLock lock(&instances_mu_);
    accumulator_instances_.erase(accumulator);
  }
  v1::DropAccumulatorRequest req;
  req.set_accumulator(accumulator);
  v1::DropAccumulatorResponse resp;
  grpc::ClientContext ctx;
  PrepareContext(call, &ctx);
  return FromGrpcStatus(NextConnection().stub->DropAccumulator(&ctx, req, &resp));
}

absl::StatusOr<std::string> LossClient::Health(const std::string& service,
                                               const CallOptions& call) {
  grpc::ClientContext ctx;
  PrepareContext(call, &ctx);
  return CheckHealth(*NextConnection().generic, &ctx, service);
}

absl::StatusOr<ServerInfoResult> LossClient::ServerInfo(const CallOptions& call) {
  v1::ServerInfoRequest req;
  v1::ServerInfoResponse resp;
  grpc::ClientContext ctx;
  PrepareContext(call, &ctx);
  LOSSD_RETURN_IF_ERROR(FromGrpcStatus(NextConnection().stub->ServerInfo(&ctx, req, &resp)));
  ServerInfoResult info;
  info.version = resp.version();
  info.instance = resp.instance();
  info.backend = resp.backend();
  info.device = resp.device();
  info.memory_total_bytes = resp.memory_total_bytes();
  info.memory_budget_bytes = resp.memory_budget_bytes();
  info.memory_in_use_bytes = resp.memory_in_use_bytes();
  info.weight_cache_budget_bytes = resp.weight_cache_budget_bytes();
  info.weight_cache_bytes = resp.weight_cache_bytes();
  info.max_part_bytes = resp.max_part_bytes();
  info.max_bt = resp.max_bt();
  info.max_h = resp.max_h();
  info.max_v = resp.max_v();
  info.max_in_flight = resp.max_in_flight();
  info.accumulators = resp.accumulators();
  info.features.assign(resp.features().begin(), resp.features().end());
  return info;
}

absl::StatusOr<std::vector<StateEntry>> LossClient::List(const CallOptions& call) {
  LOSSD_RETURN_IF_ERROR(RequireFeature("list_state", call));
  v1::ListRequest req;
  v1::ListResponse resp;
  grpc::ClientContext ctx;
  PrepareContext(call, &ctx);
  LOSSD_RETURN_IF_ERROR(FromGrpcStatus(NextConnection().stub->List(&ctx, req, &resp)));
  std::vector<StateEntry> entries;
  for (const v1::StateEntry& e : resp.entries()) {
    StateEntry s;
    s.kind = e.kind() == v1::STATE_ACCUMULATOR ? StateEntry::Kind::kAccumulator
                                               : StateEntry::Kind::kWeights;
    s.name = e.name();
    s.bytes = e.bytes();
    s.last_used_unix_ms = e.last_used_unix_ms();
    s.micro_batches = e.micro_batches();
    entries.push_back(std::move(s));
  }
  return entries;
}

absl::Status LossClient::RequireFeature(absl::string_view feature, const CallOptions& call) {
  std::optional<std::pair<std::string, std::vector<std::string>>> known;
  {
    absl::MutexLock lock(&features_mu_);
    known = features_;
  }
  if (!known.has_value()) {
    absl::StatusOr<ServerInfoResult> info = ServerInfo(call);
    if (!info.ok()) return info.status();
    known.emplace(info->version, info->features);
    absl::MutexLock lock(&features_mu_);
    features_ = known;
  }
  const std::vector<std::string>& features = known->second;
  if (std::find(features.begin(), features.end(), feature) != features.end()) {
    return absl::OkStatus();
  }
  return absl::UnimplementedError(absl::StrCat(
      "the server (lossd ", known->first, ") does not support '", feature,
      "' (not in its ServerInfo.features): upgrade the server to use it"));
}

void TuneMallocForLargeMessages() {
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  mallopt(M_TRIM_THRESHOLD, INT_MAX);
}

}  // namespace client
}  // namespace lossd
