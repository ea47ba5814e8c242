// SPDX-License-Identifier: Apache-2.0
#include "bench/service/raw_wire.h"

#include <atomic>
#include <chrono>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/channel_arguments.h"
#include "grpcpp/support/client_callback.h"
#include "grpcpp/support/slice.h"

namespace lossd {
namespace bench {
namespace {

class RawStream final : public grpc::ClientBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  RawStream(std::vector<grpc::ByteBuffer> out,
            const std::function<absl::Status(const grpc::ByteBuffer&)>& on_message)
      : out_(std::move(out)), on_message_(on_message) {}

  absl::Status Run(grpc::GenericStub* stub, const std::string& method, grpc::ClientContext* ctx) {
    ctx_ = ctx;
    stub->PrepareBidiStreamingCall(ctx, method, grpc::StubOptions(), this);
    StartRead(&in_);
    WriteNext();
    StartCall();
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(&done_));
    if (!handler_status_.ok()) return handler_status_;
    if (status_.ok()) return absl::OkStatus();
    return absl::Status(static_cast<absl::StatusCode>(status_.error_code()),
                        status_.error_message());
  }

  void OnWriteDone(bool ok) override {
    if (!ok) return;  // the call is broken; OnDone brings the status
    ++next_;
    WriteNext();
  }

  void OnReadDone(bool ok) override {
    if (!ok) return;
    absl::Status s = on_message_(in_);
    if (!s.ok()) {
      {
        absl::MutexLock lock(&mu_);
        handler_status_ = std::move(s);
      }
      ctx_->TryCancel();
      return;
    }
    StartRead(&in_);
  }

  void OnDone(const grpc::Status& status) override {
    absl::MutexLock lock(&mu_);
    status_ = status;
    done_ = true;
  }

 private:
  // The same as client/stream_call.cc's StartNextWrite on purpose: the raw client measures the
  // wire without any client code.
  void WriteNext() {
    if (next_ + 1 < out_.size()) {
      StartWrite(&out_[next_]);
    } else if (next_ + 1 == out_.size()) {
      StartWriteLast(&out_[next_], grpc::WriteOptions());
    } else if (out_.empty()) {
      StartWritesDone();
    }
  }

  std::vector<grpc::ByteBuffer> out_;
  size_t next_ = 0;
  grpc::ByteBuffer in_;
  const std::function<absl::Status(const grpc::ByteBuffer&)>& on_message_;
  grpc::ClientContext* ctx_ = nullptr;
  absl::Mutex mu_;
  bool done_ ABSL_GUARDED_BY(mu_) = false;
  grpc::Status status_ ABSL_GUARDED_BY(mu_);
  absl::Status handler_status_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

absl::Status RunStream(grpc::GenericStub* stub, const std::string& method,
                       std::vector<grpc::ByteBuffer> out,
                       const std::function<absl::Status(const grpc::ByteBuffer&)>& on_message,
                       absl::Duration deadline) {
  grpc::ClientContext ctx;
  if (deadline != absl::InfiniteDuration()) {
    ctx.set_deadline(std::chrono::system_clock::now() + absl::ToChronoNanoseconds(deadline));
  }
  RawStream stream(std::move(out), on_message);
  return stream.Run(stub, method, &ctx);
}

std::vector<std::shared_ptr<grpc::Channel>> MakeChannels(const std::string& target, int n) {
  // Process-wide, so channels made by different calls never compare equal either.
  static std::atomic<int> next_index{0};
  std::vector<std::shared_ptr<grpc::Channel>> channels;
  for (int k = 0; k < n; ++k) {
    const int i = next_index.fetch_add(1);
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(64 << 20);
    args.SetMaxSendMessageSize(64 << 20);
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    args.SetInt("lossd.bench.connection_index", i);
    channels.push_back(
        grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args));
  }
  return channels;
}

}  // namespace bench
}  // namespace lossd
