// SPDX-License-Identifier: Apache-2.0
#include "client/stream_call.h"

#include <algorithm>
#include <deque>
#include <thread>
#include <utility>

#include "absl/random/random.h"
#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "grpcpp/support/client_callback.h"

namespace lossd {
namespace client {
namespace {

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
  // on_sent (nullable): called once, on a gRPC thread, when the last message has been
  // written; it must return quickly.
  StreamCall(std::vector<grpc::ByteBuffer> out, MessageHandler on_message,
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
    // caller's wire::SliceTracker waits for those).
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
  MessageHandler on_message_;
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

}  // namespace

absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
}

std::string NewRequestId() {
  // One generator per thread: absl::BitGen is not thread-safe, and stripes run on threads.
  thread_local absl::BitGen gen;
  return absl::StrFormat("%016x", absl::Uniform<uint64_t>(gen));
}

absl::Status WithRequestId(const absl::Status& s, absl::string_view request_id) {
  if (s.ok()) return s;
  absl::Status out(s.code(), absl::StrCat(s.message(), " (request_id ", request_id, ")"));
  s.ForEachPayload(
      [&out](absl::string_view url, const absl::Cord& payload) { out.SetPayload(url, payload); });
  return out;
}

absl::Status StripeGroup::Run(const std::function<absl::Status(int)>& body) {
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

void StripeGroup::Register(int i, grpc::ClientContext* ctx) {
  absl::MutexLock lock(&mu_);
  contexts_[i] = ctx;
  if (cancel_all_) {
    ctx->TryCancel();
    cancelled_[i] = true;
  }
}

void StripeGroup::Unregister(int i) {
  absl::MutexLock lock(&mu_);
  contexts_[i] = nullptr;
}

void StripeGroup::Finish(int i, absl::Status status) {
  absl::MutexLock lock(&mu_);
  ++finished_;
  if (status.ok()) return;
  failed_.push_back(i);
  const bool aborted = status.code() == absl::StatusCode::kAborted;
  statuses_[i] = std::move(status);
  cancel_at_ = std::min(cancel_at_, absl::Now() + (aborted ? grace_ : absl::ZeroDuration()));
}

void StripeGroup::CancelAllLocked() {
  if (cancel_all_) return;
  cancel_all_ = true;
  for (int i = 0; i < n_; ++i) {
    if (contexts_[i] == nullptr) continue;
    contexts_[i]->TryCancel();
    cancelled_[i] = true;
  }
}

absl::Status RunStream(grpc::GenericStub* stub, const char* method,
                       const std::function<void(grpc::ClientContext*)>& prepare,
                       std::vector<grpc::ByteBuffer> out, MessageHandler on_message,
                       StripeGroup* group, int stripe, std::function<void()> on_sent) {
  grpc::ClientContext ctx;
  prepare(&ctx);
  const std::string request_id = NewRequestId();
  ctx.AddMetadata(kRequestIdKey, request_id);
  if (group != nullptr) group->Register(stripe, &ctx);
  StreamCall stream(std::move(out), std::move(on_message), std::move(on_sent));
  absl::Status status = stream.Run(stub, method, &ctx);
  if (group != nullptr) group->Unregister(stripe);
  return WithRequestId(status, request_id);
}

}  // namespace client
}  // namespace lossd
